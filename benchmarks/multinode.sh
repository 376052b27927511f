#!/usr/bin/env bash
# The multi-machine path on one GPU machine: a scheduler and one `dask cuda worker` per GPU
# started by hand over UCX (NVLink), then `cumf-dask train` joining them through
# cluster.address (what several machines sharing a store would run).
#   bash benchmarks/multinode.sh STORE [ITERATIONS]
# STORE: an existing rating store (e.g. one bench_iteration.py generated). Logs go to $OUT.
set -uo pipefail
STORE=$1; ITERS=${2:-6}; OUT=${OUT:-/tmp/cumf-multinode}; mkdir -p "$OUT"
WORK=$(mktemp -d)
dask scheduler --protocol ucx --scheduler-file "$WORK/scheduler.json" --no-show \
  > "$OUT/scheduler.log" 2>&1 &
SCHED=$!
for _ in $(seq 60); do [ -s "$WORK/scheduler.json" ] && break; sleep 0.5; done
dask cuda worker --scheduler-file "$WORK/scheduler.json" --enable-nvlink \
  --enable-tcp-over-ucx --resources "cumf-compute=1" --nthreads 2 > "$OUT/workers.log" 2>&1 &
WORKERS=$!
ADDRESS=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['address'])" \
  "$WORK/scheduler.json")
cat > "$WORK/job.yaml" <<YAML
data: {source: store, store: $STORE}
model: {factors: 100, regularization: 0.05, iterations: $ITERS}
cluster: {address: "$ADDRESS", backend: cupy}
output: {dir: $WORK/runs, name: multinode, checkpoint: false}
YAML
python3 - "$WORK/scheduler.json" <<'PY'
import sys
from distributed import Client
with Client(scheduler_file=sys.argv[1], timeout="60s") as c:
    c.wait_for_workers(1, timeout=120)
    print("workers:", len(c.scheduler_info()["workers"]), "scheduler", c.scheduler.address)
PY
python3 -m cumf_dask train "$WORK/job.yaml" 2>&1 | grep -v "distributed\." | tee "$OUT/train.log"
kill $WORKERS; sleep 2; kill $SCHED; wait 2>/dev/null
