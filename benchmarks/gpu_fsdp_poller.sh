#!/usr/bin/env bash
# On a lent 2-GPU machine (issue 33): the library's FSDP2 path against hand-written FSDP2, each
# mode in its own torchrun, alternated ROUNDS times (machines of one kind differ by 30 %: only
# rows of one call compare); then the per-step cost of run's progress reporting (the device
# poller under NCCL): bench_overhead.py under torchrun and under resilient-strategy run.
set -u
export PYTHONPATH="$PWD/src" NCCL_NVLS_ENABLE=0 RESILIENT_STRATEGY_CACHE_DIR="$(mktemp -d)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; log="$OUT/fsdp-poller.md"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$log"
for round in $(seq "${ROUNDS:-3}"); do
  for mode in ${MODES:-lib-fsdp hand-fsdp lib-fsdp-handloop}; do
    echo "## round $round bench $mode" >>"$log"
    timeout 200 torchrun --nproc_per_node 2 benchmarks/bench_fsdp_speed.py --modes "$mode" \
      --steps "${STEPS:-40}" 2>&1 | grep "^|" | tail -1 >>"$log"
  done
done
for round in 1 2; do
  echo "## overhead under torchrun (no progress), round $round" >>"$log"
  timeout 200 torchrun --nproc_per_node 2 benchmarks/bench_overhead.py --steps 300 2>&1 \
    | grep -E "^\||overhead|params" >>"$log"
  echo "## overhead under resilient-strategy run (progress + device poller), round $round" >>"$log"
  timeout 200 python -m resilient_strategy run --nproc-per-node 2 benchmarks/bench_overhead.py \
    --steps 300 2>&1 | grep -E "^\||overhead|params|summary" >>"$log"
done
cat "$log"
