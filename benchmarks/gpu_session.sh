#!/usr/bin/env bash
# The multi-GPU evidence (issue 14), in one command on a 2-GPU machine (run by hand; CI has no GPU):
#   bash benchmarks/gpu_session.sh                        # every group (about 25 minutes)
#   bash benchmarks/gpu_session.sh --only decision,fidelity,shm   # some groups: a command limit
#   bash benchmarks/gpu_session.sh --cpu-check            # the same steps on CPU (plumbing check)
# Prints doctor, then runs benchmarks/bench_gpu_evidence.py (its docstring lists every row),
# which appends its raw output and the table to benchmarks/results/h200x2-<date>.md (not in
# --cpu-check) and prints the table. Groups can run in separate calls: each appends.
# Leaves NCCL_NVLS_ENABLE and the other multicast-off variables exactly as the machine set them.
set -u
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OMP_NUM_THREADS="${OMP_NUM_THREADS:-4}"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
echo "NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE-unset}"
echo "== doctor"; $PY -m resilient_strategy doctor || true
echo "== evidence"; exec $PY benchmarks/bench_gpu_evidence.py "$@"
