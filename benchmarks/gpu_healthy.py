"""Issue 41 (c) on a GPU machine: the main example's MLP through the library against the same
loop written by hand (DDP over the library's own process group when there are several ranks),
alternated in one run, on the GPUs torchrun gives it; plus the step the library measured
(`to_dict()["measured_step"]`, the CUDA-event path of `frameworks/stepmeter`).

    torchrun --nproc_per_node <GPUs> benchmarks/gpu_healthy.py [--rounds 3 --steps 200]

Rank 0 prints one ``RESULT {json}`` line and a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--depth", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=1024)
    a = p.parse_args()
    sys.path.insert(0, str(ROOT / "src"))
    import resilient_strategy

    features, classes = 1024, 10
    params = features * a.hidden + (a.depth - 1) * a.hidden**2 + a.hidden * classes
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=a.global_batch, gradient_bytes=4 * params,
        precision="fp32")  # the hand-written loop is fp32: the same arithmetic on both sides
    import torch
    import torch.nn.functional as F

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = [torch.nn.Linear(features, a.hidden), torch.nn.GELU()]
        for _ in range(a.depth - 1):
            layers += [torch.nn.Linear(a.hidden, a.hidden), torch.nn.GELU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(a.hidden, classes))

    dev = sel.device
    with sel.scope():
        lib = build()
    lib_opt = torch.optim.AdamW(lib.parameters(), lr=1e-4)
    lib, lib_opt, _ = sel.prepare(lib, lib_opt)
    world = sel.world_size
    raw = build().to(dev)
    if world > 1:
        raw = torch.nn.parallel.DistributedDataParallel(raw)
    raw_opt = torch.optim.AdamW(raw.parameters(), lr=1e-4)
    acc, per = sel.accumulation_steps, sel.per_replica_batch_size or 1
    g = torch.Generator(device="cpu").manual_seed(sel.rank)
    xs = torch.randn(acc, per, features, generator=g).to(dev)
    ys = torch.randint(0, classes, (acc, per), generator=g).to(dev)

    def lib_steps(n: int) -> None:
        for _ in range(n):
            for i in range(acc):
                with sel.accumulate(lib):
                    sel.backward(F.cross_entropy(lib(xs[i]), ys[i]))
                sel.step(lib_opt)

    def hand_steps(n: int) -> None:
        for _ in range(n):
            for i in range(acc):
                (F.cross_entropy(raw(xs[i]), ys[i]) / acc).backward()
            raw_opt.step()
            raw_opt.zero_grad(set_to_none=True)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize()

    def timed(run: Any, n: int) -> float:
        sync()
        if world > 1:
            torch.distributed.barrier()
        t = time.perf_counter()
        run(n)
        sync()
        if world > 1:
            torch.distributed.barrier()
        return a.global_batch * n / (time.perf_counter() - t)

    lib_steps(30)  # warm-up, and the library's measuring window (steps 6-25)
    hand_steps(30)
    out: dict[str, Any] = {"label": sel.candidate.label, "world": world, "acc": acc,
                           "per": per,                            "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "CPU", "library": [], "hand": []}
    for r in range(a.rounds):
        order = (("library", lib_steps), ("hand", hand_steps))
        for name, run in (order if r % 2 == 0 else order[::-1]):
            out[name].append(timed(run, a.steps))
    out["measured_step"] = sel.to_dict().get("measured_step")
    sel.shutdown()
    if sel.rank == 0:
        print("RESULT " + json.dumps(out), flush=True)
        lm, hm = statistics.median(out["library"]), statistics.median(out["hand"])
        print(f"| {out['gpu']} x{world} | {out['label']} | {lm:,.0f} | {hm:,.0f} | {lm / hm:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
