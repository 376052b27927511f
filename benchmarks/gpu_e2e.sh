#!/usr/bin/env bash
# On a GPU machine: the gpu-marked test suite, then whole-pipeline iteration benchmarks
# (Netflix and YahooMusic shapes, f=100, through Dask + dask-cuda) and the generator on the
# GPU. Logs and JSON records go to ${OUT:-/tmp/cumf-gpu}; a short table is printed last.
#   bash benchmarks/gpu_e2e.sh [netflix|all]
set -uo pipefail
OUT=${OUT:-/tmp/cumf-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L | tee "$OUT/device.txt"
python3 -m pytest -q -p no:cacheprovider -m gpu tests 2>&1 | tee "$OUT/gpu-tests.log" | tail -3
run() { python3 benchmarks/bench_iteration.py --backend cupy --data /tmp/cumf-bench \
          --json "$OUT/e2e.jsonl" "$@" 2>&1 | grep -v "distributed\.\|^\s*$" | tee -a "$OUT/e2e.log"; }
run --preset netflix --factors 100 --lam 0.05 --iterations 6
if [ "${1:-netflix}" = all ]; then
  run --preset yahoomusic --factors 100 --lam 1.4 --iterations 4
  python3 benchmarks/bench_generate.py --preset netflix --scale 1 --workers 0 --repeats 2 --gpu \
    --dir /tmp 2>&1 | tail -8 | tee "$OUT/generate.log"
fi
echo "== summary"
tail -1 "$OUT/gpu-tests.log"
python3 - "$OUT/e2e.jsonl" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    print(f"{r['device']:<28} {r['shape'][0]:>9,} x {r['shape'][1]:>7,} nnz {r['nnz']:>11,} "
          f"f={r['factors']} median {r['median_seconds_per_iteration']:.3f} s/it "
          f"(X {r['median_x_seconds']:.3f}, Theta {r['median_theta_seconds']:.3f}) "
          f"test RMSE {r['iterations'][-1].get('test_rmse', float('nan')):.4f}")
PY
