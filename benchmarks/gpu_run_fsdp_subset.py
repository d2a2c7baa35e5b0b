"""`resilient-strategy run` binding FSDP's workers to the freest GPUs, on a machine of 4+ GPUs.

    python benchmarks/gpu_run_fsdp_subset.py [--leave-gib 10] [--deadline-s 400]

A holder process fills GPUs 0 and 2 up to ``--leave-gib`` free (another job sharing them), then
the supervisor plans ``examples/torch_fsdp_train.py`` for a model whose size is given with
``--param-bytes`` (the example's real model is small), sized so that FSDP over the four GPUs or
over three does not fit GPUs 0 and 2 while FSDP over GPUs 1 and 3 does, and the run starts two workers
bound to them (CUDA_VISIBLE_DEVICES). Prints the supervisor's lines, each worker's bound-devices
line, which GPUs the workers' processes ran on (nvidia-smi, sampled while they train), the
optimizer steps and the exit code. Without 4 CUDA GPUs it says "skipped" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HOLD = r"""
import sys, time, torch
gib = float(sys.argv[1])
held = [torch.empty(int(gib * 2**30), dtype=torch.uint8, device=f"cuda:{d}") for d in (0, 2)]
torch.cuda.synchronize()
print("held", flush=True)
time.sleep(3600)
"""


def _smi(query: str) -> list[list[str]]:
    out = subprocess.run(["nvidia-smi", f"--query-{query}", "--format=csv,noheader"],
                         capture_output=True, text=True, timeout=30).stdout
    return [[f.strip() for f in line.split(",")] for line in out.splitlines() if line.strip()]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--leave-gib", type=float, default=10.0)
    ap.add_argument("--deadline-s", type=float, default=400.0)
    args = ap.parse_args()
    # nvidia-smi, not torch: a CUDA context of this process would show on every GPU
    try:
        rows = _smi("gpu=index,uuid,memory.free")
    except (OSError, subprocess.SubprocessError):
        rows = []
    if len(rows) < 4:
        print("skipped: fewer than 4 CUDA GPUs")
        return 0
    uuids = {row[1]: int(row[0]) for row in rows}
    mib = {int(row[0]): float(row[2].split()[0]) for row in rows}
    free_gib = min(mib[1], mib[3]) / 1024
    args.fill_gib = mib[0] / 1024 - args.leave_gib
    # FSDP over n needs 4P/n + 3 units of P/8: over 2, 2.375 P (on 90% of the freest GPUs'
    # memory); over 4, 1.375 P, more than 90% of what GPUs 0 and 2 keep
    args.param_gib = 0.8 * 0.9 * free_gib / 2.375
    print(f"free on GPUs 1,3: {free_gib:.1f} GiB; filling GPUs 0,2 with {args.fill_gib:.1f} "
          f"GiB; parameters {args.param_gib:.1f} GiB")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PYTHONUNBUFFERED": "1"}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(args.fill_gib)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        free = {int(r[0]): r[1] for r in _smi("gpu=index,memory.free")}
        print("free memory the supervisor sees:", free)
        cmd = [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "4",
               "--global-batch-size", "96", "--param-bytes", str(int(args.param_gib * 2**30)),
               "--sharding", "full", "--evidence-dir", "/tmp/rs-evidence",
               str(ROOT / "examples" / "torch_fsdp_train.py"), "--global-batch-size", "96",
               "--samples", "96000", "--epochs", "1"]
        run = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd="/tmp")
        seen: set[int] = set()
        deadline = time.monotonic() + args.deadline_s
        while run.poll() is None and time.monotonic() < deadline:
            for r in _smi("compute-apps=pid,gpu_uuid,used_memory"):
                used = r[2].split()[0] if len(r) > 2 else ""
                # the holder's rows (its fill) aside: the probes' and the workers'
                if used.isdigit() and int(used) < 0.9 * args.fill_gib * 1024:
                    seen.add(uuids.get(r[1], -1))
            time.sleep(0.5)
        if run.poll() is None:
            run.kill()
        out, err = run.communicate(timeout=60)
    finally:
        holder.kill()
        holder.wait(timeout=30)
    print("== supervisor (stderr, our lines)")
    for line in err.splitlines():
        if line.startswith("resilient-strategy run:") or "resilient_strategy:" in line:
            print(line[:400])
    print("== workers (stdout, selected)")
    for line in out.splitlines():
        if any(k in line for k in ("Bound by", "Chose", "chose", "sharded (FSDP2)",
                                   "optimizer steps", "epoch")):
            print(line[:400])
    print("== table")
    print("| measure | value |\n|---|---|")
    print(f"| GPUs the training processes ran on (nvidia-smi, sampled) | {sorted(seen)} |")
    steps = [ln for ln in out.splitlines() if "optimizer steps:" in ln]
    print(f"| optimizer steps | {steps[-1].split(':')[-1].strip() if steps else 'none'} |")
    print(f"| exit code | {run.returncode} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
