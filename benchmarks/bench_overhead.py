"""Per-step cost of the library's PyTorch training path against the same loop written by hand.

    python benchmarks/bench_overhead.py                               # one device
    torchrun --nproc_per_node 2 benchmarks/bench_overhead.py          # DDP on both

Both loops train the same model on the same device with the same process group and the same
micro-batches; the hand-written one calls DDP / no_sync / backward / step itself, the other goes
through sel.prepare / sel.accumulate / sel.backward / sel.step. Prints a markdown table (rank 0).
(TensorFlow needs no such comparison: ``sel.strategy`` *is* the native MirroredStrategy object.)
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import resilient_strategy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--micro-batch", type=int, default=128)
    ap.add_argument("--accumulation", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    procs = int(os.environ.get("WORLD_SIZE", "1"))
    sel = resilient_strategy.resilient_strategy(
        framework="torch", precision="fp32", max_per_replica_batch=args.micro_batch,
        global_batch_size=args.micro_batch * args.accumulation * procs,
    )
    if not sel.active:  # a one-device fallback under torchrun trains on rank 0 alone
        return
    import torch
    import torch.nn.functional as F

    world = sel.launch.world_size if sel.num_replicas > 1 else 1
    # The library's runtime accumulates over sel.accumulation_steps, which can exceed
    # --accumulation (a fallback to fewer devices accumulates more): both loops use it.
    acc = sel.accumulation_steps

    def build() -> torch.nn.Module:
        torch.manual_seed(0)
        layers: list[torch.nn.Module] = []
        for _ in range(args.depth):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
        return torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))

    with sel.scope():
        lib_model = build()
    lib_opt = torch.optim.SGD(lib_model.parameters(), lr=1e-3)
    lib_model, lib_opt, _ = sel.prepare(lib_model, lib_opt)
    device = sel.device
    raw = build().to(device)
    if world > 1:  # the same process group the selection initialized
        raw = torch.nn.parallel.DistributedDataParallel(
            raw, device_ids=[device.index] if device.type == "cuda" else None)
    raw_opt = torch.optim.SGD(raw.parameters(), lr=1e-3)
    xs = torch.randn(acc, args.micro_batch, args.hidden, device=device)
    ys = torch.randint(0, 10, (acc, args.micro_batch), device=device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def hand_step() -> None:
        for i in range(acc):
            ctx = raw.no_sync() if world > 1 and i < acc - 1 else torch.enable_grad()
            with ctx:
                (F.cross_entropy(raw(xs[i]), ys[i]) / acc).backward()
        raw_opt.step()
        raw_opt.zero_grad(set_to_none=True)

    def lib_step() -> None:
        for i in range(acc):
            with sel.accumulate(lib_model):  # forward and backward inside (DDP no_sync)
                with sel.autocast():
                    loss = F.cross_entropy(lib_model(xs[i]), ys[i])
                sel.backward(loss)
            sel.step(lib_opt)

    times: dict[str, list[float]] = {"hand-written": [], "resilient_strategy": []}
    for _ in range(10):  # warm-up
        hand_step()
        lib_step()
    for _ in range(args.steps):  # interleaved, so drift hits both alike
        for name, fn in (("hand-written", hand_step), ("resilient_strategy", lib_step)):
            sync()
            t = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - t)
    if sel.is_main_process:
        params = sum(p.numel() for p in raw.parameters())
        print(f"\n{sel.candidate.label}; {world} process(es); {params / 1e6:.1f}M params; "
              f"micro-batch {args.micro_batch} x {acc} accumulation; {args.steps} steps each")
        print("| loop | median ms/step | p10 | p90 |\n|---|---|---|---|")
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=10)
            print(f"| {name} | {statistics.median(ts) * 1e3:.3f} | {q[0] * 1e3:.3f} | "
                  f"{q[-1] * 1e3:.3f} |")
        h, r = (statistics.median(times[k]) for k in times)
        print(f"overhead: {(r - h) * 1e3:+.3f} ms/step ({(r / h - 1) * 100:+.1f}%)")
    sel.shutdown()


if __name__ == "__main__":
    main()
