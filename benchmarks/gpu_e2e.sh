#!/usr/bin/env bash
# On a GPU machine: the gpu-marked tests, then loading (store -> GPU), the whole-pipeline
# iteration benchmark and the generator, Netflix shape. Logs go to ${OUT:-/tmp/cumf-gpu};
# a short summary is printed last.
#   bash benchmarks/gpu_e2e.sh [quick]
set -uo pipefail
OUT=${OUT:-/tmp/cumf-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"; nproc | tee -a "$OUT/device.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -5
cd benchmarks
python3 bench_load.py --preset netflix --nnz 99000000 --gpu --repeats 3 2>&1 | tee "$OUT/load.log"
python3 bench_iteration.py --backend cupy --preset netflix --nnz 99000000 --factors 100 \
  --iterations 10 --json "$OUT/e2e.jsonl" 2>&1 | grep -v "distributed\.\|^\s*$" | tee "$OUT/e2e.log"
if [ "${1:-}" != quick ]; then
  python3 bench_generate.py --preset netflix --scale 1 --workers 0 --repeats 1 --gpu \
    --dir /tmp 2>&1 | tail -6 | tee "$OUT/generate.log"
fi
echo "== summary"
tail -1 "$OUT/gpu-tests.log"
grep -E "^(row|col) |disk|first update" "$OUT/load.log"
grep -E "median seconds|fit\(\) wall" "$OUT/e2e.log"
grep -E "M/s" "$OUT/generate.log" 2>/dev/null
