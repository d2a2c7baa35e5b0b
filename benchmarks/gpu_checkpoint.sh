#!/usr/bin/env bash
# Issue 33.4's GPU rows in one command on a 2-GPU machine (run by hand; CI has no GPU), about
# 3-4 minutes (each step has its own deadline; at most about 6):
#   bash benchmarks/gpu_checkpoint.sh [OUT_DIR]
# 1. one GPU: the step time with no checkpoint, sync and async checkpoints every 10 and every 30
#    steps (an MLP 2048x8, AdamW: ~400 MB of weights and moments), bench_checkpoint.py;
# 2. the same on both GPUs with DDP, then with FSDP2 (--sharding full: torch's async_save);
# 3. an exact resume after a SIGKILL of rank 0 during an in-flight asynchronous write, under
#    `resilient-strategy run --nproc-per-node 2`, DDP then FSDP2: the killed job resumes from
#    the previous complete checkpoint and ends with the uninterrupted job's weights.
# Each result is written to OUT_DIR (default: $OUT, else ./gpu-out) as soon as it is measured;
# a step that fails or runs past its deadline leaves its output and the next one runs. Leaves
# NCCL_NVLS_ENABLE and the other multicast-off variables exactly as the machine set them.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
scratch=$(mktemp -d)  # checkpoints and the cache: GBs, never results
trap 'rm -rf "$scratch"' EXIT
export RESILIENT_STRATEGY_CACHE_DIR="${RESILIENT_STRATEGY_CACHE_DIR:-$scratch/cache}"
PY=${PY:-python3}
{
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  df -h "$out" | tail -1
} 2>&1 | tee "$out/machine.txt"
table="--device cuda --hidden 2048 --depth 8 --batch 256 --steps 40 --every 30 --rounds 2"
timeout 75 $PY benchmarks/bench_checkpoint.py $table --dir "$scratch/ckpt-1gpu" \
  2>&1 | tee "$out/checkpoint-1gpu.md"
timeout 75 $PY -m torch.distributed.run --standalone --nproc_per_node 2 \
  benchmarks/bench_checkpoint.py $table --dir "$scratch/ckpt-ddp" 2>&1 | tee "$out/checkpoint-ddp.md"
timeout 75 $PY -m torch.distributed.run --standalone --nproc_per_node 2 \
  benchmarks/bench_checkpoint.py $table --sharding full --dir "$scratch/ckpt-fsdp" \
  2>&1 | tee "$out/checkpoint-fsdp.md"
rm -rf "$scratch"/ckpt-1gpu "$scratch"/ckpt-ddp "$scratch"/ckpt-fsdp
for sharding in none full; do
  timeout 200 $PY benchmarks/bench_checkpoint.py --resume-check --device cuda --nproc 2 \
    --hidden 2048 --sharding "$sharding" --out "$scratch/resume-$sharding" \
    2>&1 | tee "$out/resume-$sharding.md"
  rm -rf "$scratch/resume-$sharding"
done
