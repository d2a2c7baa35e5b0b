#!/usr/bin/env bash
# The NCCL probe as training runs it, on a 2-GPU machine (issue 31: the probe meets through torch's
# TCPStore, proves all-reduce, broadcast and all-gather, and forms NCCL's connections at init /
# runs NCCL's own diagnostics where the NCCL in use has them).
#
#     OUT=/some/dir bash benchmarks/gpu_probe_collectives.sh
#
# Needs torch with CUDA and 2 GPUs; no network (everything on loopback). Takes about 1-2 minutes,
# bounded at 170 s. Leaves every NCCL_* variable as the caller set it (NCCL_NVLS_ENABLE=0
# included) and writes its results under $OUT as it goes:
#   env.txt         torch, NCCL, GPUs and the NCCL_* / USE_LIBUV variables it ran with
#   probes.jsonl    one line per run_probe of NCCL on GPUs 0,1 (cold: the fork server closed
#                   after each), alternating: "default" (the probe sets NCCL_RUNTIME_CONNECT=0 on
#                   NCCL >= 2.22) and "lazy" (NCCL_RUNTIME_CONNECT=1 set by the caller, which the
#                   probe keeps: connections formed lazily, as probes did before issue 31)
#   decision.json   a cold decision (fresh cache) of torch on the 2 GPUs: the choice, the probe
#                   results and every trace event
#   explain.txt     that decision's explain()
#   summary.md      the table printed at the end
# There is no switch back to the file-store rendezvous or the all-reduce-only proof: the probe's
# cost before issue 31 is not measured here; the phases show what the broadcast and all-gather
# checks cost (from "measured" to "collectives").
set -u
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python}"
echo "results under $OUT"

{
  date -u
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda,
"nccl", torch.cuda.nccl.version() if torch.cuda.is_available() else None,
"gpus", torch.cuda.device_count())' 2>&1
  nvidia-smi -L 2>&1 | head -8
  env | grep -E '^(NCCL_|USE_LIBUV=|CUDA_VISIBLE_DEVICES=|TORCH_NCCL_)' | sort
} > "$OUT/env.txt"
cat "$OUT/env.txt"

timeout -k 5 170 "$PY" - "$OUT" <<'EOF'
import json, os, statistics, sys, tempfile, time
from pathlib import Path

out = Path(sys.argv[1])
from resilient_strategy.core.knowledge import nccldiag
from resilient_strategy.core.measures.probe import ProbeSpec
from resilient_strategy.probing.prober import run_probe

base = {k: v for k, v in os.environ.items()
        if k not in ("RESILIENT_STRATEGY_PROBE_FAULT", "NCCL_RUNTIME_CONNECT")}
user_rc = os.environ.get("NCCL_RUNTIME_CONNECT")
spec = ProbeSpec("torch:nccl:0,1", "torch", "nccl", (0, 1), world_size=2, timeout_s=60.0)
costs = {"default": [], "lazy": []}
last = {}
for i in range(3):
    for mode in ("default", "lazy") if i % 2 == 0 else ("lazy", "default"):
        env = dict(base)
        if mode == "lazy":
            env["NCCL_RUNTIME_CONNECT"] = "1"
        elif user_rc is not None:
            env["NCCL_RUNTIME_CONNECT"] = user_rc
        t = time.perf_counter()
        res = run_probe(spec, env)
        dt = time.perf_counter() - t
        costs[mode].append(dt)
        last[mode] = res
        line = {"mode": mode, "run": i, "seconds": round(dt, 3), **res.to_dict()}
        with open(out / "probes.jsonl", "a") as f:
            f.write(json.dumps(line) + "\n")
        print(f"{mode:8s} run {i}: {res.status} {res.cause or ''} {dt:.2f} s; "
              f"extra {list(res.extra)}", flush=True)

import resilient_strategy

denv = {**base, "WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2",
        "MASTER_PORT": "0"}
if user_rc is not None:
    denv["NCCL_RUNTIME_CONNECT"] = user_rc
with tempfile.TemporaryDirectory(prefix="rs-gpu-cache-") as cache:  # a fresh cache, removed
    t = time.perf_counter()
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64,
                                                probe="force", cache_dir=cache, timeout=60,
                                                env=denv)
    decide_s = time.perf_counter() - t
d = sel.to_dict()
(out / "decision.json").write_text(json.dumps({"seconds": decide_s, **d}, indent=1, default=str))
(out / "explain.txt").write_text(sel.explain(verbose=True))
print(sel.explain(verbose=True), flush=True)

rows = ["| measurement | median of 3 | phases of the last run (s from the first worker's start) |",
        "|---|---|---|"]
for mode, words in (("default", "run_probe NCCL x2, connections at init (probe's default)"),
                    ("lazy", "run_probe NCCL x2, NCCL_RUNTIME_CONNECT=1 kept (lazy)")):
    res = last[mode]
    rows.append(f"| {words}: {res.status} | {statistics.median(costs[mode]):.2f} s | "
                + ", ".join(f"{k} {v:.2f}" for k, v in res.phases) + " |")
    ph = dict(res.phases)
    if "measured" in ph and "collectives" in ph:
        rows.append(f"|   broadcast + all-gather checks ({mode}) | "
                    f"{ph['collectives'] - ph['measured']:.2f} s | |")
rows.append(f"| cold decision, fresh cache: {sel.candidate.label} | {decide_s:.2f} s | |")
report, set_, kept = nccldiag.from_extra(last["default"].extra)
summary = "\n".join(rows) + (
    f"\n\nrendezvous: {dict(last['default'].extra).get('rendezvous')}; NCCL variables set: "
    f"{list(set_)}, kept: {list(kept)}; NCCL diagnostics findings: "
    f"{[(f.report, f.check, f.ok, f.text) for f in report.findings]}\n\ntrace events:\n"
    + "\n".join(f"- {e['kind']}: {e.get('text', '')}" for e in d.get("events", [])))
(out / "summary.md").write_text(summary + "\n")
print(summary)
EOF
echo "exit $? (results under $OUT)"
