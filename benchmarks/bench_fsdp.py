"""FSDP2 through a Selection against a hand-written ``fully_shard`` loop, and a sharded checkpoint
resumed on another number of processes (issue 24).

    python benchmarks/bench_fsdp.py [--world 2] [--steps 40] [--repeat 3] [--resume-to 1]

Each run is ``torchrun --nproc_per_node W`` of this file in worker mode, on the CPU over gloo
(CUDA_VISIBLE_DEVICES=""), with a deadline. Both loops train the same residual MLP (blocks
sharded one by one, then the root), on the same data order (DistributedSampler, seed 0), with
AdamW, the same global batch; throughput counts the optimizer steps after the warm-up ones, in
the training loop only (the decision, its probe included, is outside it). The runs alternate,
and the median of ``--repeat`` runs of each is reported. Then the resume check: a run of
``--steps`` steps checkpointing half-way, against a run stopped half-way and relaunched on
``--resume-to`` processes: the loss of every step after the checkpoint must match.
Prints a markdown table; the goals: the same loss, throughput ratio >= 0.97.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SRC = str(Path(__file__).resolve().parents[1] / "src")
FEATURES, CLASSES, SAMPLES, BATCH, WARMUP = 64, 10, 8192, 256, 5
RUN_DEADLINE_S = 600


# ----- worker (one rank, under torchrun) --------------------------------------------------------
def _model(hidden: int, depth: int) -> Any:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(hidden)
            self.up = torch.nn.Linear(hidden, 4 * hidden)
            self.down = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x: Any) -> Any:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, hidden), *[Block() for _ in range(depth)],
                               torch.nn.Linear(hidden, CLASSES))


def _data() -> Any:
    import torch

    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    return torch.utils.data.TensorDataset(x, y)


def _batches(loader: Any, set_epoch: Any) -> Any:
    epoch = 0
    while True:
        set_epoch(epoch)
        yield from loader
        epoch += 1


def _paired(args: argparse.Namespace) -> None:
    """Both loops in the same processes, over the same process group, in alternating chunks of
    ``--chunk`` optimizer steps: each chunk's pair of throughputs saw the same machine load."""
    import torch
    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.utils.data.distributed import DistributedSampler

    import resilient_strategy

    model = _model(args.hidden, args.depth)
    block = type(model[1])
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=BATCH, model=model, sharding="full", quiet=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = torch.utils.data.DataLoader(_data(), batch_size=sel.batch_size, shuffle=True,
                                         drop_last=True)
    model, opt, loader = sel.prepare(model, opt, loader, shard_modules=[block])
    sel_batches = _batches(loader, sel.set_epoch)

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    hand = _model(args.hidden, args.depth)  # the same initial weights (seed 0)
    hand_block = type(hand[1])  # _model defines its Block class anew: this model's own
    mesh = init_device_mesh("cpu", (world,))
    for m in hand:
        if isinstance(m, hand_block):
            fully_shard(m, mesh=mesh)
    fully_shard(hand, mesh=mesh)
    hand_opt = torch.optim.AdamW(hand.parameters(), lr=1e-3)
    sampler = DistributedSampler(_data(), num_replicas=world, rank=rank, shuffle=True)
    hand_batches = _batches(torch.utils.data.DataLoader(
        _data(), batch_size=BATCH // world, sampler=sampler, drop_last=True), sampler.set_epoch)

    def hand_step() -> float:
        x, y = next(hand_batches)
        loss = F.cross_entropy(hand(x), y)
        loss.backward()
        hand_opt.step()
        hand_opt.zero_grad(set_to_none=True)
        return float(loss.detach())

    def sel_step() -> float:
        total = 0.0
        for _ in range(sel.accumulation_steps):
            x, y = next(sel_batches)
            with sel.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                sel.backward(loss)
            total += float(loss.detach()) / sel.accumulation_steps
            sel.step(opt)
        return total

    losses: dict[str, list[float]] = {"hand": [], "selection": []}
    rates: dict[str, list[float]] = {"hand": [], "selection": []}
    cpu: dict[str, list[float]] = {"hand": [], "selection": []}  # per CPU-second of this rank
    for name, step in (("hand", hand_step), ("selection", sel_step)):  # warm-up, not timed
        losses[name] += [step() for _ in range(WARMUP)]
    for i in range(args.rounds):
        pair = (("hand", hand_step), ("selection", sel_step))
        for name, step in pair if i % 2 == 0 else pair[::-1]:
            t0, c0 = time.perf_counter(), time.process_time()
            losses[name] += [step() for _ in range(args.chunk)]
            rates[name].append(args.chunk * BATCH / (time.perf_counter() - t0))
            cpu[name].append(args.chunk * BATCH / (time.process_time() - c0))
    for name in losses:  # the mean over the ranks: the loss of the global batch
        t = torch.tensor(losses[name], dtype=torch.float64)
        dist.all_reduce(t)
        losses[name] = (t / world).tolist()
    if rank == 0:
        Path(args.out).write_text(json.dumps({"losses": losses, "rates": rates, "cpu": cpu}))
    sel.shutdown()


def _worker(args: argparse.Namespace) -> None:
    import torch
    import torch.nn.functional as F

    model = _model(args.hidden, args.depth)
    block = type(model[1])
    losses: list[float] = []
    if args.worker == "hand":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.utils.data.distributed import DistributedSampler

        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        mesh = init_device_mesh("cpu", (world,))
        for m in model:
            if isinstance(m, block):
                fully_shard(m, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        sampler = DistributedSampler(_data(), num_replicas=world, rank=rank, shuffle=True)
        loader = torch.utils.data.DataLoader(_data(), batch_size=BATCH // world, sampler=sampler,
                                             drop_last=True)
        batches = _batches(loader, sampler.set_epoch)
        t0 = 0.0
        for step in range(args.steps):
            if step == WARMUP:
                t0 = time.perf_counter()
            x, y = next(batches)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()))
        seconds = time.perf_counter() - t0
        done = args.steps
    else:
        import resilient_strategy

        sel = resilient_strategy.resilient_strategy(
            framework="torch", global_batch_size=BATCH, model=model, sharding="full", quiet=True)
        rank, world = sel.launch.rank, sel.num_replicas
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        loader = torch.utils.data.DataLoader(_data(), batch_size=sel.batch_size, shuffle=True,
                                             drop_last=True)
        ckpt = sel.checkpoint(args.checkpoint_dir, every_steps=args.checkpoint_every) \
            if args.checkpoint_dir else None
        model, opt, loader = sel.prepare(model, opt, loader, shard_modules=[block])
        start = sel.optimizer_steps
        epoch = ckpt.epoch if ckpt is not None else 0
        t0, at, step_loss = 0.0, start, 0.0
        while sel.optimizer_steps < args.steps:
            sel.set_epoch(epoch)
            for x, y in loader:
                if sel.optimizer_steps == start + WARMUP and at == start:
                    t0, at = time.perf_counter(), sel.optimizer_steps
                with sel.accumulate(model):
                    loss = F.cross_entropy(model(x), y)
                    sel.backward(loss)
                step_loss += float(loss.detach()) / sel.accumulation_steps
                last = sel.is_last_micro_step
                sel.step(opt)
                if last:
                    losses.append(step_loss)
                    step_loss = 0.0
                if sel.optimizer_steps >= args.steps:
                    break
            epoch += 1
        seconds = time.perf_counter() - t0
        done = sel.optimizer_steps - at
        if ckpt is not None:
            ckpt.save()
    # the loss of each optimizer step over the whole global batch (the mean over the ranks)
    if world > 1:
        import torch.distributed as dist

        t = torch.tensor(losses, dtype=torch.float64)
        dist.all_reduce(t)
        losses = (t / world).tolist()
    if rank == 0:
        Path(args.out).write_text(json.dumps({
            "losses": losses, "seconds": seconds,
            "steps_timed": done - WARMUP if args.worker == "hand" else done,
            "world": world}))
    if args.worker == "hand":
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()
    else:
        sel.shutdown()


# ----- driver -----------------------------------------------------------------------------------
def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _launch(world: int, worker: str, out: Path, steps: int, env: dict[str, str],
            *extra: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world),
            "--master_port", str(_port()), __file__, "--worker", worker, "--out", str(out),
            "--steps", str(steps), *extra]
    run = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=RUN_DEADLINE_S)
    if run.returncode:
        raise SystemExit(f"{worker} x{world} failed:\n{run.stdout[-2000:]}\n{run.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _resume(args: argparse.Namespace, tmp: Path, env: dict[str, str], size: list[str]) -> str:
    """A run of ``--steps`` steps checkpointing half-way, and a run stopped half-way then
    relaunched on ``--resume-to`` processes: the table row comparing their later losses."""
    half = args.steps // 2
    every = ["--checkpoint-every", str(half)]
    whole = _launch(args.world, "selection", tmp / "whole.json", args.steps, env, *size,
                    "--checkpoint-dir", str(tmp / "ck-whole"), *every)
    _launch(args.world, "selection", tmp / "first.json", half, env, *size,
            "--checkpoint-dir", str(tmp / "ck-moved"), *every)
    moved = _launch(args.resume_to, "selection", tmp / "moved.json", args.steps, env, *size,
                    "--checkpoint-dir", str(tmp / "ck-moved"), *every)
    tail = whole["losses"][half:]
    diff = max(abs(a - b) for a, b in zip(tail, moved["losses"], strict=True))
    return (f"| resume {args.world} -> {args.resume_to} processes at step {half} | "
            f"{len(tail)} steps after it (uninterrupted) | {len(moved['losses'])} steps resumed "
            f"| max loss difference {diff:.2e} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--resume-to", type=int, default=1)
    ap.add_argument("--only-resume", action="store_true", help="skip the throughput runs")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=8, help="paired rounds in one launch")
    ap.add_argument("--chunk", type=int, default=5, help="optimizer steps per paired chunk")
    ap.add_argument("--worker", choices=("hand", "selection", "paired"), help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-dir", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint-every", type=int, default=1000, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker == "paired":
        _paired(args)
        return
    if args.worker:
        _worker(args)
        return

    tmp = Path(tempfile.mkdtemp(prefix="bench-fsdp-"))
    env = {**os.environ, "PYTHONPATH": SRC, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "RESILIENT_STRATEGY_CACHE_DIR": str(tmp / "cache")}
    size = ["--hidden", str(args.hidden), "--depth", str(args.depth)]
    rates: dict[str, list[float]] = {"hand": [], "selection": []}
    last: dict[str, list[float]] = {}
    _launch(args.world, "selection", tmp / "warm.json", WARMUP + 1, env, *size)  # probe, cached
    if args.only_resume:
        print(_resume(args, tmp, env, size))
        return
    for i in range(args.repeat):
        for worker in ("hand", "selection") if i % 2 == 0 else ("selection", "hand"):
            r = _launch(args.world, worker, tmp / f"{worker}{i}.json", args.steps, env, *size)
            rates[worker].append(r["steps_timed"] * BATCH / r["seconds"])
            last[worker] = r["losses"]
    hand, sel = statistics.median(rates["hand"]), statistics.median(rates["selection"])
    loss_diff = max(abs(a - b) for a, b in zip(last["hand"], last["selection"], strict=True))
    paired = _launch(args.world, "paired", tmp / "paired.json", 0, env, *size,
                     "--rounds", str(args.rounds), "--chunk", str(args.chunk))
    ratios = [s / h for s, h in zip(paired["rates"]["selection"], paired["rates"]["hand"],
                                    strict=True)]
    cpu_ratios = [s / h for s, h in zip(paired["cpu"]["selection"], paired["cpu"]["hand"],
                                        strict=True)]
    p_loss = max(abs(a - b) for a, b in zip(paired["losses"]["hand"],
                                            paired["losses"]["selection"], strict=True))

    resumed = _resume(args, tmp, env, size)

    print(f"FSDP2 on CPU over gloo, {args.world} processes, {args.steps} steps of global batch "
          f"{BATCH} (median of {args.repeat} runs each; {args.hidden}x{args.depth} residual MLP)")
    print()
    print("| measure | hand-written fully_shard | via the Selection | goal |")
    print("|---|---|---|---|")
    print(f"| samples/s | {hand:,.0f} | {sel:,.0f} | ratio {sel / hand:.3f} (>= 0.97) |")
    print(f"| loss after {args.steps} steps | {last['hand'][-1]:.6f} | "
          f"{last['selection'][-1]:.6f} | max step-wise difference {loss_diff:.2e} |")
    print(f"| paired in one launch: {args.rounds} rounds x {args.chunk} steps, samples/s | "
          f"{statistics.median(paired['rates']['hand']):,.0f} | "
          f"{statistics.median(paired['rates']['selection']):,.0f} | median ratio "
          f"{statistics.median(ratios):.3f} (>= 0.97); loss difference {p_loss:.2e} |")
    print(f"| paired, per CPU-second of rank 0 (less sensitive to other load) | "
          f"{statistics.median(paired['cpu']['hand']):,.0f} | "
          f"{statistics.median(paired['cpu']['selection']):,.0f} | median ratio "
          f"{statistics.median(cpu_ratios):.3f} |")
    print(resumed)
    print(f"\nall runs: hand {[round(r) for r in rates['hand']]}, selection "
          f"{[round(r) for r in rates['selection']]} samples/s; paired ratios "
          f"{[round(r, 3) for r in ratios]}; per CPU-second {[round(r, 3) for r in cpu_ratios]}")


if __name__ == "__main__":
    main()
