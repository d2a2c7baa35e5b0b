"""Issue 41 (a): what the decision does on described healthy machines, with and without the model.

Each case of ``examples/machines/healthy/`` describes a healthy machine (NVLink pair, NVSwitch
eight, PCIe consumer cards with P2P off proven, PCIe data-centre cards), a model by its gradient
size (``gradient_bytes=``, what ``model=`` gives) and what each probe proved there. This script
decides each one exactly as ``resilient-strategy plan --simulate FILE`` does, once as written
(with the model) and once with the model's size removed, and prints the GPUs kept out of those
the job was given, per case and in total, as a Markdown table.

Before/after a change of the planner::

    git worktree add /tmp/base <commit>
    cp -r examples/machines/healthy /tmp/base/examples/machines/
    PYTHONPATH=/tmp/base/src python benchmarks/bench_healthy.py   # before
    PYTHONPATH=src python benchmarks/bench_healthy.py             # after

Part (b), ``--part b``: on this CPU machine, under ``torchrun --nproc_per_node 2`` with gloo
(started by this script), the MLP of ``examples/torch_train.py`` (its default width, depth and
global batch 256) trained through the library (``sel.prepare`` / ``sel.accumulate`` /
``sel.backward`` / ``sel.step``: the step measured over optimizer steps 6-25, nothing of the
measurement left after) against the same loop written by hand with
DDP on the same process group, alternated (``--rounds`` of ``--steps`` optimizer steps each,
after a warm-up), samples/s of each round; then the per-step cost of the measurement: the
meter's bookkeeping per optimizer step in its window and out of it, and the gradient hook's own
cost per parameter (in the window; removed after), each timed over many calls::

    python benchmarks/bench_healthy.py --part b [--rounds 3 --steps 60]

Part (c) (two GPUs against hand-written DDP / FSDP2) is not in this script yet.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
HEALTHY = ROOT / "examples" / "machines" / "healthy"
MODEL_KEYS = ("gradient_bytes", "param_bytes")


def decide(data: dict[str, Any]) -> tuple[int, str]:
    """(replicas, "backend xN accA") of the decision for one described case."""
    from resilient_strategy.cli import simulate_file

    with tempfile.TemporaryDirectory(prefix="rs-bench-healthy-") as tmp:
        path = Path(tmp) / "case.json"
        path.write_text(json.dumps(data), encoding="utf-8")
        (sel,) = simulate_file(path).values()
    env = ",".join(f"{k}={v}" for k, v in sorted(sel.env.items()))
    what = f"{sel.backend}{' ' + env if env else ''} x{sel.num_replicas}"
    if sel.accumulation_steps > 1:
        what += f" acc {sel.accumulation_steps}"
    return sel.num_replicas, what


def rows(directory: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted(directory.glob("*.json")):
        data = json.loads(path.read_text(encoding="utf-8"))
        gpus = int(data["machine"]["gpus"])
        with_model = decide(data)
        without = decide({k: v for k, v in data.items() if k not in MODEL_KEYS})
        out.append({"case": path.stem, "framework": data["framework"], "gpus": gpus,
                    "gradient_bytes": data.get("gradient_bytes"),
                    "with_model": with_model, "without_model": without})
    return out


def table(found: list[dict[str, Any]]) -> str:
    lines = ["| case | framework | gradients | with model= | kept | without | kept |",
             "|---|---|---|---|---|---|---|"]
    for r in found:
        grad = f"{r['gradient_bytes'] / 1e6:,.0f} MB" if r["gradient_bytes"] else "-"
        (wk, ww), (nk, nw) = r["with_model"], r["without_model"]
        lines.append(f"| {r['case']} | {r['framework']} | {grad} | {ww} | {wk}/{r['gpus']} | "
                     f"{nw} | {nk}/{r['gpus']} |")
    total = sum(r["gpus"] for r in found)
    kept_with = sum(r["with_model"][0] for r in found)
    kept_without = sum(r["without_model"][0] for r in found)
    idle_with = sum(1 for r in found if r["with_model"][0] < r["gpus"])
    idle_without = sum(1 for r in found if r["without_model"][0] < r["gpus"])
    lines += ["", f"GPUs kept with model=: {kept_with}/{total} ({idle_with} of {len(found)} "
              f"machines leave GPUs idle); without: {kept_without}/{total} ({idle_without} of "
              f"{len(found)})."]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# (b): samples/s through the library against hand-written DDP, under torchrun with gloo
# --------------------------------------------------------------------------------------------
FEATURES, CLASSES = 32, 10  # examples/torch_train.py


def _worker(rounds: int, steps: int, hidden: int, depth: int, global_batch: int) -> None:
    """One torchrun rank: both loops, alternated; rank 0 prints one JSON line."""
    sys.path.insert(0, str(ROOT / "src"))
    import resilient_strategy

    params = FEATURES * hidden + (depth - 1) * hidden**2 + hidden * CLASSES
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=global_batch, gradient_bytes=4 * params,
        precision="fp32")
    import torch
    import torch.nn.functional as F

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, hidden), torch.nn.GELU()]
        for _ in range(depth - 1):
            layers += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(hidden, CLASSES))

    with sel.scope():
        lib = build()
    lib_opt = torch.optim.AdamW(lib.parameters(), lr=1e-3)
    lib, lib_opt, _ = sel.prepare(lib, lib_opt)
    world = sel.world_size
    raw = build()
    if world > 1:
        raw = torch.nn.parallel.DistributedDataParallel(raw)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-3)
    acc, per = sel.accumulation_steps, sel.per_replica_batch_size or 1
    g = torch.Generator().manual_seed(sel.rank)
    xs = torch.randn(acc, per, FEATURES, generator=g)
    ys = torch.randint(0, CLASSES, (acc, per), generator=g)

    def lib_steps(n: int) -> None:
        for _ in range(n):
            for i in range(acc):
                with sel.accumulate(lib):
                    sel.backward(F.cross_entropy(lib(xs[i]), ys[i]))
                sel.step(lib_opt)

    def hand_steps(n: int) -> None:
        for _ in range(n):
            for i in range(acc):
                sync = world == 1 or i == acc - 1
                with (torch.enable_grad() if sync else raw.no_sync()):  # type: ignore[operator]
                    (F.cross_entropy(raw(xs[i]), ys[i]) / acc).backward()
            raw_opt.step()
            raw_opt.zero_grad(set_to_none=True)

    def timed(run: Any, n: int) -> float:
        if world > 1:
            torch.distributed.barrier()
        t = time.perf_counter()
        run(n)
        if world > 1:
            torch.distributed.barrier()
        return global_batch * n / (time.perf_counter() - t)

    lib_steps(5)  # warm-up: the library's window opens after these
    hand_steps(5)
    out: dict[str, Any] = {"label": sel.candidate.label, "world": world, "acc": acc,
                           "per": per, "library": [], "hand": []}
    for r in range(rounds):
        order = (("library", lib_steps), ("hand", hand_steps))
        for name, run in (order if r % 2 == 0 else order[::-1]):
            out[name].append(timed(run, steps))
    out["measured"] = [e.to_dict() for e in sel.measured_events]
    out["cost"] = _measurement_cost()
    sel.shutdown()
    if sel.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)


def _measurement_cost(calls: int = 20000) -> dict[str, float]:
    """Microseconds: the meter's bookkeeping per optimizer step of one micro-step, in its
    window and after it; the communication hook per bucket, timing and pass-through (around
    an inner hook that returns a completed future: the hook's own cost, no collective)."""
    import torch

    from resilient_strategy.frameworks.stepmeter import StepMeter

    def per_call(fn: Any, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            fn()
        return (time.perf_counter() - t) / n * 1e6

    meter = StepMeter(start=0, steps=10**9)
    meter.micro_step(True, 1)  # open the window

    def in_window() -> None:
        meter.update_begins()
        meter.micro_step(True, 8)

    closed = StepMeter(live=False)

    def out_of_window() -> None:  # what the runtime's hot path does after the window
        if closed.live:
            closed.micro_step(True, 8)

    # a parameter's post-accumulate-grad hook, as autograd calls it (in the window only: the
    # hooks are removed when it closes)
    param = torch.nn.Parameter(torch.zeros(4))
    hooked = StepMeter()
    hooked._timing = True
    grad_hook = hooked._grad_ready
    return {"bookkeeping_in_window_us": per_call(in_window, calls),
            "bookkeeping_after_us": per_call(out_of_window, calls),
            "grad_hook_us": per_call(lambda: grad_hook(0, param), calls)}


def part_b(rounds: int, steps: int, hidden: int, depth: int, global_batch: int) -> dict[str, Any]:
    """Start the worker under torchrun (2 processes, gloo, no GPU) and return rank 0's result."""
    with tempfile.TemporaryDirectory(prefix="rs-bench-healthy-") as tmp:
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1",
               "CUDA_VISIBLE_DEVICES": "", "RESILIENT_STRATEGY_CACHE_DIR": tmp}
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
             "2", str(Path(__file__).resolve()), "--worker", "--rounds", str(rounds),
             "--steps", str(steps), "--hidden", str(hidden), "--depth", str(depth),
             "--global-batch", str(global_batch)],
            env=env, capture_output=True, text=True, timeout=1800)
    line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"the torchrun worker failed ({done.returncode}):\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(line[len("RESULT "):])
    return result


def table_b(r: dict[str, Any]) -> str:
    lines = [f"Decision: {r['label']} ({r['world']} x {r['per']} x {r['acc']}).", "",
             "| round | library samples/s | hand-written DDP samples/s | ratio |",
             "|---|---|---|---|"]
    for i, (a, b) in enumerate(zip(r["library"], r["hand"], strict=True), 1):
        lines.append(f"| {i} | {a:,.0f} | {b:,.0f} | {a / b:.3f} |")
    lib, hand = statistics.median(r["library"]), statistics.median(r["hand"])
    lines.append(f"| median | {lib:,.0f} | {hand:,.0f} | {lib / hand:.3f} |")
    c = r["cost"]
    lines += ["", "| the measurement's cost | us |", "|---|---|",
              f"| bookkeeping per optimizer step, in the window | "
              f"{c['bookkeeping_in_window_us']:.2f} |",
              f"| bookkeeping per optimizer step, after the window | "
              f"{c['bookkeeping_after_us']:.3f} |",
              f"| gradient hook per parameter, in the window (none after) | "
              f"{c['grad_hook_us']:.2f} |"]
    for e in r["measured"]:
        lines += ["", f"- `{e['kind']}`: {e['text']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=Path, default=HEALTHY)
    parser.add_argument("--json", action="store_true", help="the rows as JSON")
    parser.add_argument("--part", choices=("a", "b"), default="a")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60, help="optimizer steps a round")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--depth", type=int, default=2)
    parser.add_argument("--global-batch", type=int, default=256)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args.rounds, args.steps, args.hidden, args.depth, args.global_batch)
        return 0
    if args.part == "b":
        r = part_b(args.rounds, args.steps, args.hidden, args.depth, args.global_batch)
        print(json.dumps(r, indent=1) if args.json else table_b(r))
        return 0
    found = rows(args.cases)
    print(json.dumps(found, indent=1) if args.json else table(found))
    return 0


if __name__ == "__main__":
    sys.exit(main())
