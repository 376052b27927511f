#!/bin/bash
# Builds the implicit 0.7.3 wheel with the CUDA extension (see BUILD.md)
set -euo pipefail
ROOT=${IMPLICIT_BUILD:-/tmp/implicit-build}; HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$ROOT"
SP=$ROOT/venv/lib/python3.12/site-packages
C=$SP/nvidia/cu13
export PATH=$ROOT/venv/bin:$C/bin:$PATH
export CUDACXX=$C/bin/nvcc
export CUDAToolkit_ROOT=$C
export IMPLICIT_CUDA_ARCH=90
export CMAKE_BUILD_PARALLEL_LEVEL=2
export SKBUILD_CMAKE_ARGS="-DCMAKE_CUDA_ARCHITECTURES=90;-DIMPLICIT_CURAND_SHIM=${IMPLICIT_CURAND_SHIM:-ON};-DCUDAToolkit_ROOT=$C"
# Debian's CMake does not search lib64/ in find_package(), so point at the configs directly
SKBUILD_CMAKE_ARGS="$SKBUILD_CMAKE_ARGS;-Drapids_logger_DIR=$SP/rapids_logger/lib64/cmake/rapids_logger"
SKBUILD_CMAKE_ARGS="$SKBUILD_CMAKE_ARGS;-Drmm_DIR=$SP/librmm/lib64/cmake/rmm;-Dnvtx3_DIR=$SP/librmm/lib64/cmake/nvtx3"
SKBUILD_CMAKE_ARGS="$SKBUILD_CMAKE_ARGS;-Draft_DIR=$SP/libraft/lib64/cmake/raft"
export SKBUILD_CMAKE_ARGS
export SKBUILD_BUILD_VERBOSE=true
DIST=${DIST:-$ROOT/dist}
cd $ROOT/src/implicit-0.7.3
rm -rf build $ROOT/dist-raw
python -m pip wheel --no-build-isolation --no-deps -v . -w $ROOT/dist-raw
# bundle libgomp.so.1 (needed by the CPU extensions) and set the manylinux tag;
# libcublas.so.13 / libcublasLt.so.13 (and libcurand.so.10 if IMPLICIT_CURAND_SHIM=OFF) must come from the GPU machine.
mkdir -p $DIST
auditwheel repair --exclude libcublas.so.13 --exclude libcublasLt.so.13 --exclude libcurand.so.10 \
    --plat manylinux_2_34_x86_64 -w $DIST $ROOT/dist-raw/implicit-0.7.3-cp312-cp312-linux_x86_64.whl
