"""A model that does not fit one GPU replicated, on one GPU (issue 24, item 3): planned sharded
with its state offloaded to host memory, the one-device fallback refused with the numbers, and
the single-rank FSDP2 path trained for N steps.

    python benchmarks/bench_fsdp_gpu.py [--steps 20] [--hidden 1024] [--depth 16]
                                        [--free-gib G] [--deadline-s 150]

The GPU's free memory is capped for the planner at ``--free-gib`` (default: 70% of the model's
state, so one replica cannot fit; ``RS_BENCH_FREE_GIB`` sets it too): the machine's facts are
read (``detect_facts()``), every GPU's free memory is lowered to the cap, and the decision is
made on those facts (``resilient_strategy(facts=...)``). Two decisions, one process, one GPU:

1. ``offload="none"`` (the default): every GPU candidate is ruled out by memory; the trace says
   offloading would fit, and the decision falls to the CPU (or ends in ModelDoesNotFitError
   where the host is too small).
2. ``offload="auto"``: FSDP2 on one GPU with ``CPUOffloadPolicy`` (a process group of one) is
   chosen; the model (a residual MLP of ``--depth`` blocks, built on the CPU, sharded block by
   block) trains ``--steps`` optimizer steps through ``sel.prepare`` / ``sel.backward`` /
   ``sel.step`` with AdamW. The peak GPU memory allocated must stay under the cap.

Prints a markdown table. Needs torch with CUDA (2.6+, FSDP2's CPUOffloadPolicy); no TensorFlow,
no network. Without a GPU (or torch) it says so and exits 0. The whole run has a deadline
(``--deadline-s``): training stops at it, and the table says how many steps it reached.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

GiB = 2**30


def _skip(why: str) -> None:
    print(f"bench_fsdp_gpu: skipped: {why}")
    raise SystemExit(0)


def _model(hidden: int, depth: int) -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up = torch.nn.Linear(hidden, 4 * hidden)
            self.down = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    return torch.nn.Sequential(*[Block() for _ in range(depth)])  # on the CPU


def _capped(facts: Any, cap: int) -> Any:
    gpus = tuple(dataclasses.replace(g, memory_free_bytes=min(cap, g.memory_free_bytes or cap))
                 for g in facts.gpus)
    return dataclasses.replace(facts, gpus=gpus)


def _rows(plan: Any) -> list[tuple[str, str, str, str, str]]:
    from resilient_strategy.core.trace.fitting import MemoryChecked, OffloadConsidered

    out = []
    for e in plan.events:
        rows = list(e.rows) if isinstance(e, MemoryChecked) else \
            [r for pair in e.rows for r in pair] if isinstance(e, OffloadConsidered) else []
        for r in rows:
            fits = {True: "fits", False: "does not fit", None: "unknown"}[r.fits]
            usable = "?" if r.usable_bytes is None else f"{r.usable_bytes / GiB:.2f}"
            out.append((r.candidate.label, r.where, f"{r.need_bytes / GiB:.2f}", usable, fits))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64, help="global batch (samples per step)")
    ap.add_argument("--free-gib", type=float,
                    default=float(os.environ["RS_BENCH_FREE_GIB"])
                    if os.environ.get("RS_BENCH_FREE_GIB") else None)
    ap.add_argument("--deadline-s", type=float, default=150.0)
    args = ap.parse_args()
    t_start = time.monotonic()
    try:
        import torch
    except ImportError:
        _skip("torch is not installed")
    if not torch.cuda.is_available():
        _skip("no CUDA GPU (torch.cuda.is_available() is False)")
    try:
        from torch.distributed.fsdp import CPUOffloadPolicy  # noqa: F401
    except ImportError:
        _skip(f"torch {torch.__version__} has no FSDP2 CPUOffloadPolicy")

    from resilient_strategy import resilient_strategy
    from resilient_strategy.errors import ModelDoesNotFitError
    from resilient_strategy.machine.inspect import detect_facts

    model = _model(args.hidden, args.depth)
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    state = 4 * params  # parameters + gradients + AdamW's two moments
    cap = int((args.free_gib * GiB) if args.free_gib else 0.7 * state)
    seen = detect_facts()  # NVML: no CUDA context yet (the decision comes first)
    if not seen.gpus:
        _skip("NVML sees no GPU")
    facts = _capped(seen, cap)
    common: dict[str, Any] = dict(framework="torch", facts=facts, model=model, cache=False,
                                  global_batch_size=args.batch, quiet=True, devices=[0])
    table: list[tuple[str, str]] = [
        ("GPU", seen.gpus[0].name), ("torch", torch.__version__),
        ("model", f"{args.depth} blocks x hidden {args.hidden}: {params / GiB:.2f} GiB of "
                  f"parameters, {state / GiB:.2f} GiB of state with AdamW"),
        ("free GPU memory the planner sees (cap)", f"{cap / GiB:.2f} GiB"),
    ]

    # 1. offload not allowed: the one-device fallback is refused with the numbers
    try:
        plain = resilient_strategy(**common, dry_run=True)
        table.append(("offload='none': decision", plain.candidate.label))
        p1 = plain.plan
    except ModelDoesNotFitError as exc:
        table.append(("offload='none': decision", f"ModelDoesNotFitError ({len(exc.table)} rows)"))
        p1 = None
    refused = [r for r in (p1.ruled_out if p1 is not None else ())
               if r.candidate.backend == "single_device" and r.rule == "memory"]
    table.append(("one-GPU fallback refused by memory", "yes" if refused or p1 is None else "NO"))

    # 2. offload allowed: planned sharded on one GPU, state in host memory, trained
    sel = resilient_strategy(**common, offload="auto")
    table.append(("offload='auto': decision", sel.candidate.label))
    table.append(("sharded / offloaded", f"{sel.sharded} / {sel.offload}"))
    from resilient_strategy.core.trace.fitting import OffloadConsidered

    costs = [c for e in sel.plan.events if isinstance(e, OffloadConsidered) for c in e.costs
             if c[0].key == sel.candidate.key]
    if costs:
        table.append(("estimated offload cost per step", f"{costs[0][1] + costs[0][2]:.3f} s "
                      f"(copies {costs[0][1]:.3f} s, CPU optimizer {costs[0][2]:.3f} s)"))
    table.append(("variables it set", ", ".join(f"{k}={v}" for k, v in sel.env.items()) or "-"))
    table.append(("CUDA_VISIBLE_DEVICES / devices torch sees",
                  f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')!r} / "
                  f"{torch.cuda.device_count()}; device {sel.device}"))
    print("\n".join(f"| {k} | {v} |" for k, v in table), flush=True)  # what was decided, so far
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    torch.zeros(1, device=sel.device)  # the allocator's stats exist once CUDA is initialised
    torch.cuda.reset_peak_memory_stats(sel.device)
    model, opt, _ = sel.prepare(model, opt)
    per = sel.per_replica_batch_size or args.batch
    g = torch.Generator(device="cpu").manual_seed(1)
    x = torch.randn(per, args.hidden, generator=g).to(sel.device)
    y = torch.randn(per, args.hidden, generator=g).to(sel.device)
    losses: list[float] = []
    times: list[float] = []
    steps = 0
    while steps < args.steps and time.monotonic() - t_start < args.deadline_s:
        t0 = time.perf_counter()
        for _ in range(sel.accumulation_steps):
            with sel.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(x).float(), y)  # bf16 out
                sel.backward(loss)
        steps += sel.step(opt)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    peak = torch.cuda.max_memory_allocated(sel.device)
    sel.shutdown()
    table += [
        ("optimizer steps", f"{steps} of {args.steps}" + ("" if steps == args.steps
                                                           else " (deadline reached)")),
        ("loss first -> last", f"{losses[0]:.4f} -> {losses[-1]:.4f}" if losses else "-"),
        ("median step time (after the first)",
         f"{statistics.median(times[1:]):.3f} s" if len(times) > 1 else "-"),
        ("peak GPU memory allocated", f"{peak / GiB:.2f} GiB ({'under' if peak < cap else 'OVER'}"
                                      " the cap)"),
        ("wall time", f"{time.monotonic() - t_start:.1f} s"),
    ]
    print("\n| decision | memory row (planner) | where | needs GiB | usable GiB | verdict |")
    print("|---|---|---|---|---|---|")
    for mode, rows in (("offload='none'", _rows(p1) if p1 is not None else []),
                       ("offload='auto'", _rows(sel.plan))):
        for row in rows:
            print(f"| {mode} | " + " | ".join(row) + " |")
    print("\n| measure | value |\n|---|---|")
    for k, v in table:
        print(f"| {k} | {v} |")
    ok = bool(refused or p1 is None) and sel.offload and steps >= 1 and peak < cap
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
