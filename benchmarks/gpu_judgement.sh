#!/usr/bin/env bash
# On a lent 2-GPU machine (issue 30, 32, 36): the real-fault rows under NCCL, one scenario per
# process with its own deadline, each appended to $OUT as it ends (a call cut at its limit keeps
# what finished). PART=bench (the rows) or PART=tests (the GPU-marked tests, the FSDP checkpoint).
set -u
export PYTHONPATH="$PWD/src" NCCL_NVLS_ENABLE=0
OUT="${OUT:-/tmp/out}"; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader | head -2 >"$OUT/machine.txt"
if [ "${PART:-bench}" = bench ]; then
  for row in ${ROWS:-sigstop sigkill busy_validation user_connection_reset device_assert comm_error sleepy_validation slow}; do
    timeout 170 python benchmarks/bench_realfaults.py --backend nccl --only "$row" \
      --json "$OUT/row-$row.json" >"$OUT/row-$row.txt" 2>&1
    echo "$row rc=$?" >>"$OUT/rows.txt"
  done
  cat "$OUT"/row-*.txt | grep "^|" | sort -u
else
  t() { local name=$1; shift; timeout 200 "$@" >"$OUT/$name.txt" 2>&1; echo "$name rc=$?" >>"$OUT/tests.txt"; tail -3 "$OUT/$name.txt"; }
  t device_progress python -m pytest -q -p no:xdist tests/test_device_progress_gpu.py
  t blame_real_device python -m pytest -q -p no:xdist tests/test_blame.py -k real_device
  RS_GPU_TESTS=1 t output_gpu_run python -m pytest -q -p no:xdist tests/test_output.py -k gpu_run
  RS_GPU_TESTS=1 t health python -m pytest -q -p no:xdist tests/test_health.py
  ck="$(mktemp -d)"; export RESILIENT_STRATEGY_CACHE_DIR="$ck/cache"
  t fsdp_ckpt1 python -m resilient_strategy run --nproc-per-node 2 --sharding full examples/torch_fsdp_train.py --checkpoint-dir "$ck/ckpt" --epochs 1
  t fsdp_ckpt2 python -m resilient_strategy run --nproc-per-node 2 --sharding full examples/torch_fsdp_train.py --checkpoint-dir "$ck/ckpt" --epochs 2
  (stat -c '%a %U %n' "$ck"/ckpt "$ck"/ckpt/* "$ck"/ckpt/sharded/* "$ck"/ckpt/sharded/*/* 2>&1) >"$OUT/fsdp_modes.txt"
  grep -h "resumed\|optimizer steps\|chose" "$OUT"/fsdp_ckpt*.txt; sort -u "$OUT/fsdp_modes.txt" | awk '{print $1}' | sort | uniq -c
  cat "$OUT/tests.txt"
fi
