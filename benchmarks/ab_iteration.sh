#!/usr/bin/env bash
# A/B of engine versions on one GPU: the same Netflix-shaped store, bench_iteration.py run
# once per version in the order given (repeat a name to interleave, e.g. old new old new).
#
#   git archive 02c9623 cumf_dask | (mkdir -p /tmp/ab/old && tar -x -C /tmp/ab/old)
#   bash benchmarks/ab_iteration.sh /tmp/ab/old head /tmp/ab/old head
#
# "head" is this checkout; any other argument is a folder holding a cumf_dask package.
# Prints each run's iterations 2..8 and its median (fit without per-iteration RMSE).
set -uo pipefail
export PYTHONUNBUFFERED=1
cd "$(dirname "$0")"
for v in "$@"; do
  if [ "$v" = head ]; then P=$PWD/..; else P=$(cd "$v" && pwd); fi
  echo "== $v"
  PYTHONPATH=$P:${PYTHONPATH:-} python3 bench_iteration.py --backend cupy --preset netflix \
    --nnz 99000000 --factors 100 --iterations 8 --no-eval 2>&1 | grep -E "^ +[2-8] |median|fit\(\)"
done
