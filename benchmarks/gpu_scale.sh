#!/usr/bin/env bash
# On a machine with several GPUs: scaling (1 GPU vs all, TCP vs UCX, each reduction), the
# generator on every core, and the multi-machine path (scheduler + dask cuda worker by hand).
# Logs to ${OUT:-/tmp/cumf-scale}; the tables are printed last.
#   bash benchmarks/gpu_scale.sh [yahoo]
set -uo pipefail
OUT=${OUT:-/tmp/cumf-scale}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
GPUS=$(nvidia-smi -L | wc -l)
{ nvidia-smi -L; nvidia-smi topo -m; nproc; free -g | head -2; df -h /tmp | tail -1; } > "$OUT/device.txt"
cd benchmarks
python3 bench_scaling.py --preset netflix --nnz 99000000 --factors 100 --iterations 6 \
  --gpus "$GPUS" --reductions --json "$OUT/scaling.jsonl" 2>&1 | grep -v "distributed\." \
  > "$OUT/scaling-netflix.log"
python3 bench_generate.py --preset netflix --scale 1 --workers "$(nproc)" --repeats 1 --gpu \
  --dir /tmp 2>&1 | tail -6 > "$OUT/generate.log"
OUT="$OUT" bash multinode.sh /tmp/cumf-bench/bench-netflix-99000000-scale1.zarr 6 > /dev/null 2>&1
if [ "${1:-}" = yahoo ]; then
  python3 bench_scaling.py --preset yahoomusic --factors 100 --lam 1.4 --iterations 4 \
    --gpus "$GPUS" --json "$OUT/scaling.jsonl" 2>&1 | grep -v "distributed\." \
    > "$OUT/scaling-yahoo.log"
fi
echo "== device"; head -3 "$OUT/device.txt"; grep -A4 "GPU0" "$OUT/device.txt" | head -4
echo "== netflix"; tail -9 "$OUT/scaling-netflix.log"
echo "== generate"; cat "$OUT/generate.log"
echo "== multinode"; grep -E "iteration|workers|transport|final|error" "$OUT/train.log" | tail -10
[ -f "$OUT/scaling-yahoo.log" ] && { echo "== yahoo"; tail -6 "$OUT/scaling-yahoo.log"; }
