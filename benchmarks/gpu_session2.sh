#!/usr/bin/env bash
# Second GPU pass (run by hand on a 2-GPU machine): `probe` from the command line, the per-step
# overhead of the library's training path, and no /dev/shm leak after a probe killed mid-NCCL.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export RESILIENT_STRATEGY_CACHE_DIR="${RESILIENT_STRATEGY_CACHE_DIR:-$(mktemp -d)}"
PY=${PY:-python3}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
echo "== probe (command line)"; $PY -m resilient_strategy probe --framework torch --global-batch-size 512
echo "== overhead, one GPU"; $PY benchmarks/bench_overhead.py --hidden 4096 --depth 4 --micro-batch 256 --steps 100
echo "== overhead, DDP on $NGPU GPUs"
$PY -m torch.distributed.run --nproc_per_node "$NGPU" benchmarks/bench_overhead.py --hidden 4096 \
  --depth 4 --micro-batch 256 --steps 100 2>&1 | grep -v "^W1\|OMP_NUM_THREADS\|^\*\*\*"
echo "== /dev/shm after NCCL probes killed mid-collective"
before=$(ls /dev/shm | grep -c '^nccl-')
for i in 1 2 3; do
  RESILIENT_STRATEGY_PROBE_FAULT=hang:1:nccl $PY -c "
from resilient_strategy.prober import run_probe
from resilient_strategy.probe import ProbeSpec
import os
r = run_probe(ProbeSpec('k', 'torch', 'nccl', (0, 1), world_size=2, timeout_s=12), dict(os.environ))
print(r.status, r.cause, round(r.elapsed_s, 1))"
done
after=$(ls /dev/shm | grep -c '^nccl-')
echo "nccl-* segments in /dev/shm: before $before, after $after"
pgrep -fa "resilient_strategy.probes" || echo "no probe worker left running"
