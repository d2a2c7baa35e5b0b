#!/usr/bin/env bash
# The GPU evidence, in one run on a 2-GPU machine (run by hand; CI has no GPU):
#   bash benchmarks/gpu_session.sh
# 1. doctor; 2. the GPU-marked tests; 3. the decision benchmark; 4. the PyTorch example on 2 GPUs
# healthy, then with NCCL broken by the environment, then as plain python; a table at the end.
# Leaves NCCL_NVLS_ENABLE and the other multicast-off variables exactly as the machine set them.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
export RESILIENT_STRATEGY_CACHE_DIR="${RESILIENT_STRATEGY_CACHE_DIR:-$(mktemp -d)}"
PY=${PY:-python3}
NGPU=$($PY -c 'import torch; print(torch.cuda.device_count())')
MODEL=(--hidden 4096 --depth 6 --global-batch-size $((256 * NGPU)) --samples 262144 --epochs 3)
echo "GPUs: $NGPU; NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"

echo "== 1. doctor"; $PY -m resilient_strategy doctor
echo "== 2. GPU tests"; RS_GPU_TESTS=1 $PY -m pytest -q -m gpu tests
echo "== 3. decision benchmark"; $PY benchmarks/bench_decision.py --timeout 10 --repeat 3

run() {  # label, env..., -- args
  local label=$1; shift
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  echo "== 4. $label"
  env "${envs[@]}" "$@" 2>&1 | tee /tmp/run.log | grep -vE "^\s*$" | tail -40
  local chose rate decided
  chose=$(grep -m1 "resilient_strategy chose:" /tmp/run.log | sed 's/resilient_strategy chose: //')
  decided=$(grep -m1 "decided in" /tmp/run.log | sed 's/.*decided in \([0-9.]*\) s.*/\1/')
  rate=$(grep "samples/s" /tmp/run.log | tail -1 | sed 's/.*, \([0-9,]*\) samples\/s/\1/')
  SUMMARY+=("| $label | $chose | ${decided:-?} s | ${rate:-?} |")
}
SUMMARY=()
TORCHRUN=($PY -m torch.distributed.run --nproc_per_node "$NGPU")
run "torchrun, healthy" RS=1 -- "${TORCHRUN[@]}" examples/torch_train.py "${MODEL[@]}"
run "torchrun, healthy, cached" RS=1 -- "${TORCHRUN[@]}" examples/torch_train.py "${MODEL[@]}"
run "torchrun, NCCL_ALGO=bogus" NCCL_ALGO=bogus -- "${TORCHRUN[@]}" examples/torch_train.py "${MODEL[@]}"
run "torchrun, P2P+SHM off, NCCL_SOCKET_IFNAME=nonexistent0" NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 \
  NCCL_SOCKET_IFNAME=nonexistent0 -- "${TORCHRUN[@]}" examples/torch_train.py "${MODEL[@]}"
run "torchrun, NCCL probe hangs (fault injection)" RESILIENT_STRATEGY_PROBE_FAULT=hang:1:nccl \
  RESILIENT_STRATEGY_PROBE=force RESILIENT_STRATEGY_TIMEOUT=15 \
  -- "${TORCHRUN[@]}" examples/torch_train.py "${MODEL[@]}"
run "torchrun, small model, NCCL_ALGO=bogus" NCCL_ALGO=bogus -- "${TORCHRUN[@]}" \
  examples/torch_train.py --hidden 256 --depth 2 --global-batch-size 512 --samples 262144 --epochs 3
run "plain python" RS=1 -- $PY examples/torch_train.py "${MODEL[@]}"

echo; echo "| run | decision | decided in | samples/s (last epoch) |"; echo "|---|---|---|---|"
printf '%s\n' "${SUMMARY[@]}"
