#!/usr/bin/env bash
# On a machine with several GPUs: 1 GPU against all of them over UCX (NVLink) on the Netflix
# shape, fits alternated, with where each iteration goes (--trace); with `yahoo`, the same
# on the YahooMusic shape; with `full`, also TCP and every reduction, the generator on every
# core, and the multi-machine path (scheduler + dask cuda worker by hand).
# Logs to ${OUT:-/tmp/cumf-scale}; the tables are printed last.
#   bash benchmarks/gpu_scale.sh [yahoo] [full]
set -uo pipefail
OUT=${OUT:-/tmp/cumf-scale}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
GPUS=$(nvidia-smi -L | wc -l)
YAHOO=0; FULL=0
for arg in "$@"; do
  case $arg in yahoo) YAHOO=1 ;; full) FULL=1 ;; *) echo "unknown argument: $arg" >&2; exit 2 ;; esac
done
{ nvidia-smi -L; nvidia-smi topo -m; nproc; free -g | head -2; df -h /tmp | tail -1; } > "$OUT/device.txt"
cd benchmarks
scaling() {  # log name, then bench_scaling.py arguments
  local log=$1; shift
  python3 bench_scaling.py "$@" --gpus "$GPUS" --json "$OUT/scaling.jsonl" 2>&1 \
    | grep -v "distributed\.\|UCX  WARN" > "$OUT/$log"
}
scaling scaling-netflix.log --preset netflix --nnz 99000000 --factors 100 --iterations 10 \
  --transports ucx --repeats 3 --no-eval --trace
if [ $YAHOO = 1 ]; then
  scaling scaling-yahoo.log --preset yahoomusic --factors 100 --lam 1.4 --iterations 6 \
    --transports ucx --repeats 2 --no-eval --trace
fi
if [ $FULL = 1 ]; then
  scaling scaling-netflix-full.log --preset netflix --nnz 99000000 --factors 100 \
    --iterations 6 --reductions
  python3 bench_generate.py --preset netflix --scale 1 --workers "$(nproc)" --repeats 1 --gpu \
    --dir /tmp 2>&1 | tail -6 > "$OUT/generate.log"
  STORE=$(ls -d /tmp/cumf-bench/bench-netflix-480189x17770-*.zarr | head -1)
  OUT="$OUT" bash multinode.sh "$STORE" 6 > /dev/null 2>&1
fi
echo "== device"; head -3 "$OUT/device.txt"; grep -A4 "GPU0" "$OUT/device.txt" | head -4
echo "== netflix"; tail -8 "$OUT/scaling-netflix.log"
[ $YAHOO = 1 ] && { echo "== yahoo"; tail -8 "$OUT/scaling-yahoo.log"; }
if [ $FULL = 1 ]; then
  echo "== netflix, TCP and the reductions"; tail -9 "$OUT/scaling-netflix-full.log"
  echo "== generate"; cat "$OUT/generate.log"
  echo "== multinode"; grep -E "iteration|workers|transport|final|error" "$OUT/train.log" | tail -10
fi
exit 0
