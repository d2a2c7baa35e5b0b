#!/usr/bin/env bash
# The whole suite on a GPU machine in N parallel shards (test files dealt round-robin by size),
# each under its own deadline (SIGINT, so pytest still prints its summary), logs in DIR:
#   bash benchmarks/gpu_suite_shards.sh DIR [N] [DEADLINE_S]
# then: python benchmarks/bench_gpu_evidence.py --only single --suite-log DIR/shard-*.log
set -u
cd "$(dirname "$0")/.."
dir=${1:?log directory}; n=${2:-4}; limit=${3:-330}
mkdir -p "$dir"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" RS_GPU_TESTS=1 PYTHONUNBUFFERED=1
mapfile -t files < <(ls -S tests/test_*.py)
pids=()
for ((i = 0; i < n; i++)); do
  shard=()
  for ((j = i; j < ${#files[@]}; j += n)); do shard+=("${files[j]}"); done
  timeout -s INT -k 20 "$limit" ${PY:-python3} -m pytest -q -rfEs -p no:cacheprovider \
    --durations=10 "${shard[@]}" >"$dir/shard-$i.log" 2>&1 &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
tail -n 3 "$dir"/shard-*.log
exit $rc
