"""torch's NCCL flight recorder in a stall's evidence, on one GPU (issue 20, item 4).

    python benchmarks/gpu_flight_recorder.py              # one GPU: NCCL, under 2 minutes
    python benchmarks/gpu_flight_recorder.py --cpu-check  # the same steps on CPU (gloo)

What it does:

1. In this process: which dump APIs this torch has (``_dump_nccl_trace``, ``_dump_fr_trace``)
   and whether NCCL's recorder keeps entries with no variable set (a world-size-1 NCCL group, 3
   all-reduces, dumped).
2. ``resilient-strategy run --nproc-per-node 1 --stall-timeout 6`` of a small generated script:
   one GPU trains an MLP on the decision (single_device) and, like a script that all-reduces a
   metric, runs one all-reduce per step on its own world-size-1 NCCL group.
   ``RESILIENT_STRATEGY_TRAIN_FAULT=hang:0:single_device:30:1`` hangs its main thread at step 30
   of the first launch; ``TORCH_NCCL_TRACE_BUFFER_SIZE=2000`` is set as a user would (``run``
   sets it itself only for an NCCL decision, which needs two GPUs). The supervisor judges the
   stall, asks the worker for its dump before the stop (a daemon thread answers while the main
   thread is stuck), retries once, and the job finishes.
3. Reads ``attempts.json`` and ``attempt1.txt`` from the evidence directory and prints what the
   flight recorder said: each rank's status and entry count, the collective (stuck, or the last
   one completed: one rank has no peer to wait for), the raw dump kept. Exit status 1 when no
   parsed flight-recorder entry is in the evidence.

No network, no TensorFlow; the environment passes as it is, plus the variables above.
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SRC = str(ROOT / "src")
STEPS, FAULT_STEP = 60, 30
STALL_S = 6  # --stall-timeout
RUN_TIMEOUT_S = 100  # the supervised run's own bound (the whole benchmark stays under 2 minutes)

SCRIPT = '''
import os, sys, tempfile
import resilient_strategy
sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=256)
import torch
import torch.distributed as dist

device = sel.device
# a metric all-reduce on a group of its own (world size 1), as a script that averages its loss
store = os.path.join(tempfile.mkdtemp(prefix="rs-fr-bench-"), "store")
backend = "nccl" if device.type == "cuda" else "gloo"
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.GELU(), torch.nn.Linear(512, 10))
opt = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(STEPS * 256, 64)
y = torch.randint(0, 10, (STEPS * 256,))
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                     batch_size=sel.batch_size)
model, opt, loader = sel.prepare(model, opt, loader)
steps = 0
for xb, yb in loader:
    xb, yb = xb.to(device), yb.to(device)
    with sel.accumulate(model):
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        sel.backward(loss)
    if sel.step(opt):
        steps += 1
        metric = loss.detach().clone()
        dist.all_reduce(metric)
print(f"optimizer steps: {steps}", flush=True)
dist.destroy_process_group()
sel.shutdown()
'''.replace("STEPS", str(STEPS))


def api_check(cuda: bool) -> dict[str, Any]:
    """Which dump APIs this torch has and whether its recorder keeps entries by default."""
    import torch
    import torch.distributed as dist
    from torch._C import _distributed_c10d as c10d

    out: dict[str, Any] = {"torch": torch.__version__,
                           "apis": [a for a in ("_dump_nccl_trace", "_dump_fr_trace")
                                    if hasattr(c10d, a)]}
    backend = "nccl" if cuda else "gloo"
    if os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or os.environ.get("TORCH_FR_BUFFER_SIZE"):
        out["default"] = "not checked (a buffer variable is set here)"
        return out
    with tempfile.TemporaryDirectory() as tmp:
        if cuda:
            torch.cuda.set_device(0)
        dist.init_process_group(backend, init_method=f"file://{tmp}/s", rank=0, world_size=1)
        t = torch.ones(8, device="cuda" if cuda else "cpu")
        for _ in range(3):
            dist.all_reduce(t)
        if cuda:
            torch.cuda.synchronize()
        counts = {}
        for api in out["apis"]:
            try:
                counts[api] = len(pickle.loads(getattr(c10d, api)()).get("entries", []))
            except Exception as exc:  # what this build does is the finding
                counts[api] = f"failed: {type(exc).__name__}: {exc}"
        dist.destroy_process_group()
    out["default"] = counts
    return out


def supervised(tmp: Path, cuda: bool) -> tuple[subprocess.CompletedProcess[str], float]:
    script = tmp / "train_fr.py"
    script.write_text(textwrap.dedent(SCRIPT))
    backend = "single_device" if cuda else "cpu"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [SRC, *filter(None, [os.environ.get("PYTHONPATH")])]),
        "RESILIENT_STRATEGY_TRAIN_FAULT": f"hang:0:{backend}:{FAULT_STEP}:1",
        "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache")}
    env.setdefault("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "1",
            "--stall-timeout", str(STALL_S), "--evidence-dir", str(tmp / "evidence"), str(script)]
    try:  # its workers die with it (PR_SET_PDEATHSIG) when the timeout kills it
        proc = subprocess.run(argv, env=env, cwd=tmp, capture_output=True, text=True,
                              timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        proc = subprocess.CompletedProcess(argv, 124, out, err)
    return proc, time.monotonic() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cpu-check", action="store_true", help="gloo on CPU (plumbing only)")
    args = ap.parse_args()
    sys.path.insert(0, SRC)
    import torch

    cuda = not args.cpu_check and torch.cuda.is_available()
    if not args.cpu_check and not cuda:
        print("no CUDA device: run with --cpu-check for the CPU plumbing", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    check = api_check(cuda)
    with tempfile.TemporaryDirectory(prefix="rs-fr-") as d:
        tmp = Path(d)
        proc, run_s = supervised(tmp, cuda)
        found = list((tmp / "evidence").glob("*/attempts.json"))
        attempts = json.loads(found[0].read_text())["attempts"] if found else []
        text = next(iter((tmp / "evidence").glob("*/attempt1.txt")), None)
        section = []
        if text is not None:
            lines = text.read_text().splitlines()
            start = next((i for i, ln in enumerate(lines) if ln.startswith("flight recorder:")),
                         None)
            if start is not None:
                section = lines[start:start + 12]
        raw = sorted(p.name for p in (tmp / "evidence").glob("*/attempt1._dump_*"))
    fr = attempts[0]["verdict"].get("flight") if attempts else None
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("optimizer steps:")]
    print("| what | value |\n|---|---|")
    rows = [
        ("device", torch.cuda.get_device_name(0) if cuda else "CPU (--cpu-check)"),
        ("torch", check["torch"]),
        ("dump APIs present", ", ".join(check["apis"]) or "none"),
        ("entries kept with no buffer variable (3 all-reduces)", json.dumps(check["default"])),
        ("run exit status", proc.returncode),
        ("attempts (verdict -> action)", "; ".join(
            f"{a['verdict']['kind']} -> {a['action']}" for a in attempts) or "none"),
        ("finished with", steps[-1] if steps else "no step count printed"),
        ("flight recorder, per rank", "; ".join(
            f"rank {r['rank']}: {r['status']} ({r['entries']} entries)"
            + (f" {r['reason']}" if r.get("reason") else "")
            for r in fr["ranks"]) if fr else "absent from the verdict"),
        ("stuck collective", json.dumps(fr.get("stuck")) if fr else "-"),
        ("last completed collective", json.dumps(fr.get("last")) if fr else "-"),
        ("raw dumps kept", ", ".join(raw) or "none"),
        ("supervised run wall time (s)", f"{run_s:.1f}"),
        ("whole benchmark (s)", f"{time.monotonic() - t0:.1f}"),
    ]
    for k, v in rows:
        print(f"| {k} | {str(v).replace('|', '/')} |")
    print("\nevidence file, flight recorder section:")
    print("\n".join(section) or "(none)")
    parsed = bool(fr) and any(r["entries"] for r in fr["ranks"]) and bool(
        fr.get("stuck") or fr.get("last"))
    print(f"\nRESULT: {'a parsed flight-recorder entry is in the evidence' if parsed else 'NO parsed flight-recorder entry in the evidence'}")
    if proc.returncode != 0 or not parsed:
        print(proc.stderr[-4000:], file=sys.stderr)
    return 0 if parsed else 1


if __name__ == "__main__":
    sys.exit(main())
