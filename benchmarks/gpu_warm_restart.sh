#!/usr/bin/env bash
# Issue 33, item 3, on a lent 2-GPU machine (run by hand or by the lead; CI has no GPU):
#   bash benchmarks/gpu_warm_restart.sh            # results under $OUT (default /tmp/out)
# Two ranks over NCCL under `resilient-strategy run`, rank 1 SIGKILLed at step 12 and retried:
# cold (fresh interpreters, today) against warm (--warm-start), alternating, 3 runs each,
# phase by phase (benchmarks/bench_warm_restart.py). No network needed. Under 4 minutes: each
# run has its own deadline (75 s) and the whole bench 225 s; every finished run is in
# $OUT/runs.jsonl and $OUT/warm-restart.md as it ends, so a cut keeps what finished.
# NCCL_NVLS_ENABLE and the other multicast-off variables are left exactly as the machine set them.
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PY:-python3}
{
  date -u
  echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  $PY -c "import torch; print('torch', torch.__version__, 'nccl', torch.cuda.nccl.version())"
  nproc
} >"$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
timeout 225 $PY benchmarks/bench_warm_restart.py --device cuda --repeats "${REPEATS:-3}" \
  --deadline 75 --out "$OUT/warm-restart.md" --jsonl "$OUT/runs.jsonl" >"$OUT/bench.txt" 2>&1
echo "bench rc=$?" | tee -a "$OUT/machine.txt"
cat "$OUT/warm-restart.md" 2>/dev/null || tail -20 "$OUT/bench.txt"
