#!/usr/bin/env bash
# On a lent 2-GPU machine (issue 33, items 2, 6, 7): the user-level cold start (NCCL), goodput
# under real faults three ways (NCCL), and the examples' samples/s with their data on the GPUs.
# Each part runs under its own deadline and writes to $OUT as it goes (a call cut at its limit
# keeps what finished, every goodput row as it ends). The default, PARTS="coldstart goodput",
# takes under 8 minutes; the examples (about 2 minutes) in a second call:
#   bash benchmarks/gpu_goodput.sh
#   PARTS=examples bash benchmarks/gpu_goodput.sh
#   PARTS=goodput ONLY=stop,env bash benchmarks/gpu_goodput.sh
set -u
export PYTHONPATH="$PWD/src" NCCL_NVLS_ENABLE=0
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | head -2
  python -c 'import torch; print("torch", torch.__version__, "nccl", torch.cuda.nccl.version())'
  # may a decision fork its probe workers from the caller (forkserver.why_not_here)?
  python -c 'import torch, torch.distributed, torch.nn.parallel
from resilient_strategy.probing import forkserver as f
print("after import torch, fork here refused because:", repr(f.why_not_here()))'
  nproc; date -u; } >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
for part in ${PARTS:-coldstart goodput}; do
  case "$part" in
    coldstart)  # 3 launches of each of 4 kinds, interleaved: about 3.5 minutes
      timeout 280 python benchmarks/bench_coldstart.py --device cuda --repeat "${REPEAT:-3}" \
        --out "$OUT/coldstart.md" --json "$OUT/coldstart.json" >"$OUT/coldstart.txt" 2>&1
      echo "coldstart rc=$?" >>"$OUT/parts.txt"; tail -30 "$OUT/coldstart.txt" ;;
    goodput)  # 12 jobs; the two hangs under torchrun are stopped 30 s after their fault: ~5.5 min
      timeout 330 python benchmarks/bench_goodput.py --device cuda \
        ${ONLY:+--only "$ONLY"} --out "$OUT/goodput.md" --json "$OUT/goodput.json" \
        >"$OUT/goodput.txt" 2>&1
      echo "goodput rc=$?" >>"$OUT/parts.txt"; tail -25 "$OUT/goodput.txt" ;;
    examples)  # the 100M-parameter MLP and the FSDP example, data on the GPUs
      export RESILIENT_STRATEGY_CACHE_DIR="$(mktemp -d)"
      timeout 60 torchrun --standalone --nproc_per_node 2 examples/torch_train.py --hidden 4096 \
        --depth 6 --epochs 2 --samples 50000 >"$OUT/example-torch.txt" 2>&1
      echo "example-torch rc=$?" >>"$OUT/parts.txt"
      timeout 60 torchrun --standalone --nproc_per_node 2 examples/torch_fsdp_train.py \
        --hidden 2048 --depth 8 --epochs 2 --samples 16384 >"$OUT/example-fsdp.txt" 2>&1
      echo "example-fsdp rc=$?" >>"$OUT/parts.txt"
      grep -h "chose\|samples/s" "$OUT"/example-*.txt ;;
  esac
done
cat "$OUT/parts.txt"
