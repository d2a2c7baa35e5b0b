"""The relaunch after a real SIGKILL of one rank under `resilient-strategy run`, cold (a fresh
interpreter per rank, today's start) against warm (``--warm-start``: every rank forked from one
server that imported torch once), phase by phase.

    python benchmarks/bench_warm_restart.py                      # CPU: gloo, 2 ranks
    python benchmarks/bench_warm_restart.py --device cuda        # 2 GPUs: NCCL, 2 ranks
    python benchmarks/bench_warm_restart.py --repeats 3 --out results.md

Each run trains a small MLP on 2 ranks (``--step-s`` of work per step, a checkpoint every 5
steps), and the bench sends ``kill -KILL`` to rank 1's process once rank 1 has done step
``--at``. The process is found through the run's directory (the pid each worker writes there:
``resilient_strategy.run.warm.rank_pids``; a warm child's ``/proc/<pid>/environ`` is the fork
server's, so it cannot be found by its RANK variable). The supervisor retries on the same
strategy from the checkpoint. The runs alternate cold and warm (``--repeats`` each); the table
gives medians, from the attempts' typed timelines (``attempts.json``) and the script's own
step lines:

- the relaunch: the last step of the killed attempt -> the first step of the next one, and the
  restart (fault seen -> first step after it), split into the supervisor's and each phase of
  rank 0 of the next attempt;
- the first attempt's start-up (its agent -> the first step), which a warm start changes too.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from resilient_strategy.run.warm import run_rank_pids  # noqa: E402

SCRIPT = textwrap.dedent("""
    import os, sys, time
    import resilient_strategy
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
    import torch
    marks = os.environ["RS_MARKS"]
    rank = sel.launch.rank
    step_s = float(os.environ.get("RS_STEP_S", "0.05"))
    total = int(os.environ.get("RS_STEPS", "30"))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = torch.utils.data.TensorDataset(torch.randn(4096, 32), torch.randint(0, 4, (4096,)))
    loader = torch.utils.data.DataLoader(data, batch_size=sel.batch_size, drop_last=True)
    ckpt = sel.checkpoint(sys.argv[1], every_steps=5)
    model, opt, loader = sel.prepare(model, opt, loader)
    done = False
    for epoch in range(ckpt.epoch, 100):
        sel.set_epoch(epoch)
        for x, y in loader:
            x, y = x.to(sel.device), y.to(sel.device)
            time.sleep(step_s)
            with sel.accumulate(model):
                sel.backward(torch.nn.functional.cross_entropy(model(x), y))
            sel.step(opt)
            if rank == 0:
                print(f"STEP {sel.optimizer_steps} {time.time():.6f} {os.getpid()}", flush=True)
            tmp = os.path.join(marks, f"rank{rank}.step.tmp")
            with open(tmp, "w") as fh:
                fh.write(str(sel.optimizer_steps))
            os.replace(tmp, os.path.join(marks, f"rank{rank}.step"))
            if sel.optimizer_steps >= total:
                done = True
                break
        if done:
            break
    sel.shutdown()
""")

#: (row name, how it is computed from one run's record): supervisor marks of the killed
#: attempt (a) and of the next (b), rank 0's marks of the next (r)
PHASES = (
    ("fault seen -> workers stopped", "a.fault_seen", "a.workers_stopped"),
    ("-> verdict (classify, judge)", "a.workers_stopped", "a.verdict"),
    ("-> next decision written", "a.verdict", "a.next_ready"),
    ("-> next agent built", "a.next_ready", "b.agent_started"),
    ("-> workers started (rendezvous; spawn or fork)", "b.agent_started", "b.workers_started"),
    ("-> worker code runs (interpreter start and imports, or the fork)", "b.workers_started",
     "r.worker_started"),
    ("-> resilient_strategy() took the handed decision", "r.worker_started", "r.reporting"),
    ("-> process group ready (the script imports torch, builds its model, joins the group)",
     "r.reporting", "r.comm_ready"),
    ("-> checkpoint restored", "r.comm_ready", "r.restored"),
    ("-> first optimizer step done", "r.restored", "r.first_step"),
)


def _src_env(args: argparse.Namespace, tmp: Path, marks: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}  # the caller's, as given
    (tmp / "tmp").mkdir(exist_ok=True)
    env.update({"PYTHONPATH": str(ROOT / "src"), "RS_MARKS": str(marks),
                "RS_STEP_S": str(args.step_s), "RS_STEPS": str(args.steps),
                "TMPDIR": str(tmp / "tmp"), "RESILIENT_STRATEGY_CACHE_DIR": str(args.cache)})
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    return env


def _rank_pids(tmp: Path, supervisor: int, rank: int) -> list[int]:
    """Rank ``rank``'s process in the newest attempt of the supervisor's run directory."""
    return run_rank_pids(tmp / "tmp", supervisor, rank)


def one_run(args: argparse.Namespace, warm: bool, tmp: Path) -> dict[str, Any] | str:
    """One supervised job killed once; its phases (seconds), or why it failed."""
    marks = tmp / "marks"
    marks.mkdir(parents=True)
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    started = time.time()
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient_strategy", "run", "--nproc-per-node", "2",
         "--warm-start" if warm else "--no-warm-start", str(script), str(tmp / "ckpt")],
        env=_src_env(args, tmp, marks), cwd=tmp, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True)
    try:
        return _watched(args, proc, tmp, marks, started)
    finally:
        if proc.poll() is None:  # a deadline or an interrupt: the supervisor stops its workers
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)


def _watched(args: argparse.Namespace, proc: subprocess.Popen[str], tmp: Path, marks: Path,
             started: float) -> dict[str, Any] | str:
    killed_at = None
    end = time.monotonic() + args.deadline
    while time.monotonic() < end and proc.poll() is None:
        try:
            step = int((marks / "rank1.step").read_text() or 0)
        except (OSError, ValueError):
            step = 0
        if step >= args.at:
            pids = _rank_pids(tmp, proc.pid, 1)
            if pids:
                for pid in pids:
                    os.kill(pid, signal.SIGKILL)
                killed_at = time.time()
                break
        time.sleep(0.01)
    try:
        out, _ = proc.communicate(timeout=max(1.0, end - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    (tmp / "output.txt").write_text(out)
    if killed_at is None:
        return "rank 1 was never killed"
    if proc.returncode != 0:
        return f"exit {proc.returncode}: {out[-300:]!r}"
    found = list((tmp / "resilient-strategy-evidence").glob("*/attempts.json"))
    if not found:
        return "no attempts.json"
    attempts = json.loads(found[0].read_text())["attempts"]
    if len(attempts) < 2:
        return f"{len(attempts)} attempt(s)"
    marks_of = {"a": attempts[0]["times"]["supervisor"], "b": attempts[1]["times"]["supervisor"],
                "r": attempts[1]["times"]["ranks"][0]}
    steps = [line.split() for line in out.splitlines() if line.startswith("STEP ")]
    pids = list(dict.fromkeys(s[3] for s in steps))
    first = [float(s[2]) for s in steps if s[3] == pids[0]]
    second = [float(s[2]) for s in steps if len(pids) > 1 and s[3] == pids[1]]
    got: dict[str, Any] = {}
    for name, a, b in PHASES:
        (wa, ka), (wb, kb) = a.split("."), b.split(".")
        ta, tb = marks_of[wa].get(ka), marks_of[wb].get(kb)
        got[name] = None if ta is None or tb is None else tb - ta
    a0, r0 = attempts[0]["times"]["supervisor"], attempts[0]["times"]["ranks"][0]
    seen = marks_of["a"].get("fault_seen")
    got["kill -> fault seen"] = None if seen is None else seen - killed_at
    got["restart: fault seen -> first step after it"] = (
        None if seen is None or not second else second[0] - seen)
    got["last step -> first step after the relaunch"] = (
        second[0] - first[-1] if first and second else None)
    got["first attempt's start-up: its agent -> its first step (rank 0)"] = (
        r0.get("first_step", 0) - a0.get("agent_started", 0) if r0.get("first_step") else None)
    got["job wall time (s)"] = time.time() - started
    got["resumed from"] = attempts[1].get("resumed_from")
    return got


ORDER = ("kill -> fault seen", *(p[0] for p in PHASES),
         "restart: fault seen -> first step after it",
         "last step -> first step after the relaunch",
         "first attempt's start-up: its agent -> its first step (rank 0)", "job wall time (s)")


def table(runs: dict[str, list[dict[str, Any]]]) -> str:
    lines = ["| phase (seconds, median) | cold | warm | warm - cold | cold runs | warm runs |",
             "|---|---|---|---|---|---|"]
    for name in ORDER:
        cells = []
        for mode in ("cold", "warm"):
            vals = [r[name] for r in runs[mode] if r.get(name) is not None]
            cells.append(vals)
        med = [statistics.median(v) if v else None for v in cells]
        diff = (f"{med[1] - med[0]:+.3f}" if med[0] is not None and med[1] is not None else "-")
        lines.append(
            f"| {name} | " + " | ".join("-" if m is None else f"{m:.3f}" for m in med)
            + f" | {diff} | " + " | ".join(", ".join(f"{x:.2f}" for x in v) or "-" for v in cells)
            + " |")
    resumed = {m: sorted({r.get("resumed from") for r in runs[m]}, key=str) for m in runs}
    lines.append(f"| resumed from (step) | {resumed['cold']} | {resumed['warm']} | | | |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="cpu: gloo on 2 CPU processes; cuda: NCCL on 2 GPUs")
    ap.add_argument("--repeats", type=int, default=3, help="runs per mode (alternating)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--at", type=int, default=12, help="rank 1 is killed after this step")
    ap.add_argument("--step-s", type=float, default=0.05, help="seconds of work per step")
    ap.add_argument("--deadline", type=float, default=240.0, help="seconds per run at most")
    ap.add_argument("--out", default=None,
                    help="also write the table here (markdown), rewritten after every run")
    ap.add_argument("--jsonl", default=None, help="append each run's phases here as it ends")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))  # a deadline: clean up, then go
    runs: dict[str, list[dict[str, Any]]] = {"cold": [], "warm": []}
    with tempfile.TemporaryDirectory(prefix="bench-warm-") as root:
        args.cache = Path(root) / "cache"
        # cold, warm, warm, cold, cold, warm, ...: no order effect
        order = [m for k in range(args.repeats)
                 for m in (("cold", "warm") if k % 2 == 0 else ("warm", "cold"))]
        for i, mode in enumerate(order):
            got = one_run(args, mode == "warm", Path(root) / f"run{i}-{mode}")
            if isinstance(got, str):
                print(f"run {i} ({mode}) failed: {got}", file=sys.stderr, flush=True)
                continue
            runs[mode].append(got)
            print(f"run {i} ({mode}): restart "
                  f"{got['restart: fault seen -> first step after it']}", file=sys.stderr,
                  flush=True)
            if args.jsonl:
                with open(args.jsonl, "a", encoding="utf-8") as fh:
                    fh.write(json.dumps({"mode": mode, **got}) + "\n")
            if args.out:  # what finished so far, should a deadline cut the rest
                Path(args.out).write_text(table(runs) + "\n")
    print(table(runs))


if __name__ == "__main__":
    main()
