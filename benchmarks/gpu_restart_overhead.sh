#!/usr/bin/env bash
# Issue 21's one-GPU rows in one command on a GPU machine (run by hand; CI has no GPU):
#   bash benchmarks/gpu_restart_overhead.sh [OUT_DIR]
# 1. the per-step cost of progress reporting on GPU 0 (an MLP 32-4096-10 at batch 64: a ~1 ms
#    step), with the A/A control and the reporting path's own cost (bench_supervisor.py);
# 2. a one-GPU job under `resilient-strategy run` retried on its GPU after an exit and after a
#    stall, restart against the 1-rank NCCL floor measured next to each run.
# Writes overhead.md and restart.md to OUT_DIR (default: $OUT, else ./gpu-out). Leaves
# NCCL_NVLS_ENABLE and the other multicast-off variables exactly as the machine set them.
set -u
cd "$(dirname "$0")/.."
out=${1:-${OUT:-gpu-out}}
mkdir -p "$out"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
} | tee "$out/machine.txt"
$PY benchmarks/bench_supervisor.py --device cuda --skip-recovery --hidden 4096 --steps 300 \
  --rounds 31 | tee "$out/overhead.md"
$PY benchmarks/bench_supervisor.py --device cuda --skip-overhead --repeats 3 --stall-timeout 5 \
  | tee "$out/restart.md"
