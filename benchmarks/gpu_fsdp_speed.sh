#!/usr/bin/env bash
# On a lent 2-GPU machine: the FSDP example against DDP (the numbers), then each mode of
# bench_fsdp_speed.py in its own torchrun. Results under $OUT.
set -u
export PYTHONPATH="$PWD/src" NCCL_NVLS_ENABLE=0 RESILIENT_STRATEGY_CACHE_DIR="$(mktemp -d)"
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"; log="$OUT/fsdp-speed.md"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader >"$log"
for sharding in full none; do
  echo "## example --sharding $sharding" >>"$log"
  timeout 200 torchrun --nproc_per_node 2 examples/torch_fsdp_train.py --hidden 2048 --depth 8 \
    --epochs 2 --samples 8192 --sharding "$sharding" >>"$log" 2>&1
done
for mode in ${MODES:-lib-fsdp hand-fsdp lib-ddp hand-ddp}; do
  echo "## bench $mode" >>"$log"
  timeout 200 torchrun --nproc_per_node 2 benchmarks/bench_fsdp_speed.py --modes "$mode" \
    ${PROFILE:+--profile} >>"$log" 2>&1
done
cat "$log" | grep -v "^\s*$" | tail -150
