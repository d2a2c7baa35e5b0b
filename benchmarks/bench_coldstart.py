"""The cold start a user waits for: a `torchrun` launch of a script that decides and all-reduces,
against the same launch with the process group initialised by hand (issue 33, item 6).

    python benchmarks/bench_coldstart.py [--repeat 3] [--nproc 2]             # CPU, gloo
    python benchmarks/bench_coldstart.py --device cuda --repeat 3             # GPUs, NCCL
    python benchmarks/bench_coldstart.py --src /work/main/src                 # another tree

Three launches, interleaved per repetition (load drifts on a shared host), each
``python -m torch.distributed.run --standalone --nproc_per_node N SCRIPT``, timed from the start
of torchrun to its exit:

- ``hand``: ``import torch``, ``init_process_group`` (gloo; NCCL bound to the rank's GPU with
  ``device_id``), three checked all-reduces, ``destroy_process_group``;
- ``cold``: ``resilient_strategy(framework="torch")`` with a fresh cache directory (it probes),
  then ``import torch``, the process group through ``sel.scope()``, the same three checked
  all-reduces, ``sel.shutdown()``;
- ``cached``: the same script with the cache the first cold launch filled (no probe);
- ``early``: ``cold`` with ``import torch`` written before the decision, as the README's quick
  start does (``import resilient_strategy, torch``): torch imported, nothing run with it;
- ``overlap`` (with ``--overlap``): ``cold`` with ``torch.distributed`` imported in a thread of
  the script while the decision runs (what the library could do itself: the ranks wait idle
  while local rank 0's probe runs), to measure what that would save before building it. The
  thread starts after ``import resilient_strategy``: started before it, the two threads'
  imports raced (``dataclasses`` read a partially initialised ``typing`` and raised).

Each rank marks when its script began, when each step ended (monotonic clock, one for every
process of the machine), and the decision's own account: ``sel.decided_in_s`` and, when it
probed, the probe's elapsed time and its phases (``ProbeResult.phases``: the slowest probe
rank reaching started, imported, comm_ready, checked, measured, stepped). The table gives the
medians, the ratios to ``hand`` (goal <= 1.15x) and the phases of each launch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
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
GOAL = 1.15

_COMMON = """
import json, os, sys, time
T0 = float(os.environ["RS_COLD_T0"])
marks = {"script": time.monotonic() - T0}
OUT = os.environ["RS_COLD_OUT"]
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])

def mark(name):
    marks[name] = time.monotonic() - T0

def checked_all_reduces(torch, dist, device):
    for it in range(3):
        x = torch.full((1024,), float(RANK + 1 + it * WORLD), device=device)
        dist.all_reduce(x)
        want = float(sum(r + 1 + it * WORLD for r in range(WORLD)))
        assert bool((x == want).all()), (it, x[:4])

def write(extra):
    with open(os.path.join(OUT, f"rank{RANK}.json"), "w") as fh:
        json.dump({"marks": marks, **extra}, fh)
"""

HAND = _COMMON + textwrap.dedent("""
    import datetime
    import torch
    import torch.distributed as dist
    mark("torch")
    kwargs = {}
    if os.environ["RS_COLD_DEVICE"] == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        backend, kwargs["device_id"] = "nccl", device
    else:
        device, backend = torch.device("cpu"), "gloo"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=300), **kwargs)
    mark("group")
    checked_all_reduces(torch, dist, device)
    mark("checked")
    dist.destroy_process_group()
    mark("ended")
    write({})
""")

LIBRARY = _COMMON + textwrap.dedent("""
    import resilient_strategy
    mark("import")
    if os.environ.get("RS_COLD_EARLY") == "1":  # the README's `import resilient_strategy, torch`
        import torch
        import torch.distributed
    if os.environ.get("RS_COLD_OVERLAP") == "1":  # torch imported beside the decision
        # after the package's own imports: started before them, the thread's imports raced the
        # main thread's (dataclasses read a partially initialised `typing` and raised)
        import importlib, threading
        threading.Thread(target=importlib.import_module, args=("torch.distributed",),
                         daemon=True).start()
    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=64)
    mark("decided")
    import torch
    import torch.distributed as dist
    mark("torch")
    with sel.scope():  # joins the process group, on this rank's device
        pass
    mark("group")
    checked_all_reduces(torch, dist, sel.device)
    mark("checked")
    sel.shutdown()
    mark("ended")
    result = sel.results.get(sel.candidate.key)
    write({"decided_in_s": sel.decided_in_s, "from_cache": sel.from_cache,
           "chosen": sel.candidate.label,
           "probe_s": None if result is None or sel.from_cache else result.elapsed_s,
           "probe_phases": [] if result is None or sel.from_cache else list(result.phases)})
""")

#: The phases of a launch, in order: (name, the mark that ends it). The first starts at torchrun's
#: start; a mark a script does not make (hand: no decision) is skipped.
PHASES = [("torchrun + interpreter", "script"), ("import resilient_strategy", "import"),
          ("decision", "decided"), ("import torch", "torch"), ("process group", "group"),
          ("3 checked all-reduces", "checked"), ("destroy group", "ended")]


def launch(kind: str, args: argparse.Namespace, work: Path, cache: Path) -> dict[str, Any]:
    out = work / f"out-{kind}-{time.monotonic_ns()}"
    out.mkdir()
    script = work / f"{'hand' if kind == 'hand' else 'library'}.py"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RESILIENT_STRATEGY_")
                or k == "RESILIENT_STRATEGY_MEASURED_SWITCH"}  # the caller's, as given
    env.update({"PYTHONPATH": args.src, "RS_COLD_OUT": str(out), "RS_COLD_DEVICE": args.device,
                "RS_COLD_OVERLAP": "1" if kind == "overlap" else "0",
                "RS_COLD_EARLY": "1" if kind == "early" else "0",
                "RESILIENT_STRATEGY_CACHE_DIR": str(cache), "TMPDIR": str(work / "tmp")})
    if args.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(args.nproc), str(script)]
    t0 = time.monotonic()
    env["RS_COLD_T0"] = repr(t0)
    # its own session: a deadline or an interruption ends torchrun and its workers together
    proc = subprocess.Popen(argv, env=env, cwd=work, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=args.deadline)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{kind} launch failed ({proc.returncode}):\n{output[-4000:]}")
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    shutil.rmtree(out)
    # per mark, the slowest rank (the launch waits for it)
    marks: dict[str, float] = {}
    for r in ranks:
        for name, at in r["marks"].items():
            marks[name] = max(marks.get(name, 0.0), at)
    lead = next((r for r in ranks if r.get("probe_s") is not None), ranks[0])
    return {"kind": kind, "wall_s": wall, "marks": marks,
            "decided_in_s": max((r.get("decided_in_s", 0.0) for r in ranks), default=0.0),
            "from_cache": lead.get("from_cache"), "chosen": lead.get("chosen"),
            "probe_s": lead.get("probe_s"), "probe_phases": lead.get("probe_phases", [])}


def phases_of(run: dict[str, Any]) -> list[tuple[str, float]]:
    out, last = [], 0.0
    present = [(run["marks"][key], name) for name, key in PHASES if key in run["marks"]]
    for at, name in sorted(present):  # in the order they happened (``early``: torch first)
        out.append((name, at - last))
        last = at
    out.append(("exit + torchrun's teardown", run["wall_s"] - last))
    return out


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return sorted(runs, key=lambda r: r["wall_s"])[len(runs) // 2]


def report(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace) -> str:
    hand = statistics.median(r["wall_s"] for r in runs["hand"])
    lines = [f"device {args.device}, {args.nproc} ranks, {args.repeat} launches each "
             f"(interleaved), src {args.src}", "",
             "| launch | wall s (median) | each | vs hand | goal |", "|---|---|---|---|---|"]
    kinds = list(runs)
    for kind in kinds:
        walls = [r["wall_s"] for r in runs[kind]]
        med = statistics.median(walls)
        ratio = med / hand if hand > 0 else float("nan")
        goal = "" if kind == "hand" else (f"<= {GOAL}x: " + ("met" if ratio <= GOAL else "NOT met"))
        lines.append(f"| {kind} | {med:.2f} | {', '.join(f'{w:.2f}' for w in walls)} | "
                     f"{ratio:.2f}x | {goal} |")
    lines += ["", "Phases of the median launch of each kind (seconds; each mark is the slowest "
              "rank's):", "", "| phase | " + " | ".join(kinds) + " |",
              "|---|" + "---|" * len(kinds)]
    meds = {k: median_run(v) for k, v in runs.items()}
    table = {k: dict(phases_of(r)) for k, r in meds.items()}
    for name in [p for p, _ in PHASES] + ["exit + torchrun's teardown"]:
        cells = [f"{table[k][name]:.2f}" if name in table[k] else "-"
                 for k in kinds]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    cold = meds["cold"]
    lines += ["", f"The cold decision ({cold['chosen']}): `decided_in_s` "
              f"{cold['decided_in_s']:.2f} s (the slowest rank's); cached: "
              f"{meds['cached']['decided_in_s']:.2f} s."]
    if cold["probe_s"] is not None:
        lines.append(f"Its probe: {cold['probe_s']:.2f} s, of which (from the probe's start, the "
                     "slowest probe rank): " + ", ".join(
                         f"{n} {s:.2f}" for n, s in cold["probe_phases"]) + "; the rest of the "
                     f"decision ({cold['decided_in_s'] - cold['probe_s']:.2f} s): inspecting, "
                     "planning, publishing to the other rank.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--deadline", type=float, default=300.0, help="seconds per launch")
    p.add_argument("--src", default=str(ROOT / "src"), help="the tree to run (PYTHONPATH)")
    p.add_argument("--overlap", action="store_true", help="also the `overlap` launch")
    p.add_argument("--out", default="", help="also write the table here")
    p.add_argument("--json", default="", help="also write every launch here")
    args = p.parse_args(argv)
    kinds = ["hand", "cold", "cached", "early", *(["overlap"] if args.overlap else [])]
    runs: dict[str, list[dict[str, Any]]] = {k: [] for k in kinds}
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's TERM cleans up too
    with tempfile.TemporaryDirectory(prefix="rs-coldstart-") as top:
        work = Path(top)
        (work / "tmp").mkdir()
        (work / "hand.py").write_text(HAND)
        (work / "library.py").write_text(LIBRARY)
        warm = work / "cache-warm"
        for i in range(args.repeat):
            # alternate which goes first: a launch right after another finds a warmer machine
            order = kinds if i % 2 == 0 else kinds[1:] + kinds[:1]
            for kind in order:
                cache = warm if kind == "cached" else work / f"cache-{kind}-{i}"
                if kind == "cached" and not warm.exists():
                    launch("cold", args, work, warm)  # fills it (not counted)
                run = launch(kind, args, work, cache)
                runs[kind].append(run)
                print(f"{kind}: {run['wall_s']:.2f} s", flush=True)
    text = report(runs, args)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
