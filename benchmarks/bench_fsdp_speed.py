"""Sharded training against hand-written FSDP2 and DDP on the same GPUs (issue 33).

    torchrun --nproc_per_node 2 benchmarks/bench_fsdp_speed.py [--hidden 2048] [--depth 8]
             [--steps 30] [--modes lib-fsdp,hand-fsdp,lib-ddp,hand-ddp] [--profile]

One process per GPU. The same residual MLP (``--depth`` blocks of 8*hidden^2 parameters: 268M at
2048 x 8), AdamW, bf16 autocast, global batch ``--global-batch-size``, data already on the GPU
(the loader is not measured). Each mode builds the model afresh and times ``--steps`` optimizer
steps after 5 warm-up steps, with a device sync at both ends:

- ``hand-fsdp``: ``fully_shard`` per block then root, ``MixedPrecisionPolicy(bf16, fp32)``;
- ``hand-ddp``: ``DistributedDataParallel``;
- ``lib-fsdp`` / ``lib-ddp``: ``resilient_strategy(sharding="full" | "none")`` then
  ``sel.prepare`` / ``sel.accumulate`` / ``sel.autocast`` / ``sel.backward`` / ``sel.step``;
- ``lib-fsdp-handloop``: the library's decision and ``sel.prepare``, then the hand-written loop
  (tells the cost of the setup from the cost of the per-step calls).

Rank 0 prints one markdown row per mode (samples/s, ms per step, peak GiB) and, with
``--profile``, the top CPU-time operators of five steps of each library mode. Without CUDA it
says so and exits 0.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

FEATURES, CLASSES = 32, 10  # as the example


def _model(hidden: int, depth: int) -> Any:
    """The FSDP example's model (examples/torch_fsdp_train.py) and its block class."""
    import importlib.util

    import torch

    path = Path(__file__).resolve().parents[1] / "examples" / "torch_fsdp_train.py"
    spec = importlib.util.spec_from_file_location("torch_fsdp_train", path)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    torch.manual_seed(0)
    model = example.build_model(hidden, depth)
    return model, type(model.blocks[0])


def _time(step: Any, steps: int, sync: Any) -> float:
    for _ in range(5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    sync()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--depth", type=int, default=8)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--modes", default="lib-fsdp,hand-fsdp,lib-ddp,hand-ddp")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    if not torch.cuda.is_available():
        print("bench_fsdp_speed: skipped: no CUDA")
        return
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    per = args.global_batch_size // world
    rows: list[str] = []
    profiles: list[str] = []
    sel_cache: dict[str, Any] = {}
    for mode in args.modes.split(","):
        model, block = _model(args.hidden, args.depth)
        n_params = sum(p.numel() for p in model.parameters())
        if mode.startswith("lib-"):
            import resilient_strategy

            sel = resilient_strategy.resilient_strategy(
                framework="torch", global_batch_size=args.global_batch_size, model=model,
                sharding="full" if mode.startswith("lib-fsdp") else "none", optimizer_state_factor=2.0,
                precision="bf16")
            sel_cache[mode] = sel
            device = sel.device
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
            model, opt, _ = sel.prepare(model, opt, None, shard_modules=[block])
            per_rank = sel.batch_size
            x = torch.randn(per_rank, FEATURES, device=device)
            y = torch.randint(0, CLASSES, (per_rank,), device=device)

            def step(sel: Any = sel, model: Any = model, opt: Any = opt, x: Any = x,
                     y: Any = y, handloop: bool = mode.endswith("-handloop")) -> None:
                if handloop:  # the library's setup, the hand-written loop
                    with torch.autocast("cuda", dtype=torch.bfloat16):
                        loss = F.cross_entropy(model(x), y)
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    return
                for _ in range(sel.accumulation_steps):
                    with sel.accumulate(model), sel.autocast():
                        loss = F.cross_entropy(model(x), y)
                    sel.backward(loss)
                    sel.step(opt)
            desc = (f"{sel.backend} sharded={sel.sharded} offload={sel.offload} "
                    f"precision={sel.precision} {sel.num_replicas}x{sel.per_replica_batch_size}"
                    f"x{sel.accumulation_steps}")
        else:
            if not dist.is_initialized():
                torch.cuda.set_device(local)
                dist.init_process_group("nccl", device_id=torch.device("cuda", local))
            device = torch.device("cuda", local)
            if mode == "hand-fsdp":
                from torch.distributed.device_mesh import init_device_mesh
                from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

                mesh = init_device_mesh("cuda", (world,))
                mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                for b in model.blocks:
                    fully_shard(b, mesh=mesh, mp_policy=mp)
                fully_shard(model, mesh=mesh, mp_policy=mp)
                wrapped = model
            else:
                wrapped = torch.nn.parallel.DistributedDataParallel(model.to(device),
                                                                    device_ids=[local])
            opt = torch.optim.AdamW(wrapped.parameters(), lr=1e-4)
            x = torch.randn(per, FEATURES, device=device)
            y = torch.randint(0, CLASSES, (per,), device=device)

            def step(wrapped: Any = wrapped, opt: Any = opt, x: Any = x, y: Any = y) -> None:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(wrapped(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
            desc = f"nccl world={world} {per}/rank"
        torch.cuda.reset_peak_memory_stats(device)
        secs = _time(step, args.steps, torch.cuda.synchronize)
        peak = torch.cuda.max_memory_allocated(device) / 2**30
        rate = args.steps * args.global_batch_size / secs
        rows.append(f"| {mode} | {n_params / 1e6:.0f}M | {desc} | {rate:,.0f} | "
                    f"{1e3 * secs / args.steps:.1f} | {peak:.1f} |")
        if args.profile and mode.startswith("lib-"):
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    step()
                torch.cuda.synchronize()
            profiles.append(f"### {mode}\n```\n" + prof.key_averages().table(
                sort_by="cpu_time_total", row_limit=18, max_name_column_width=60) + "\n```")
        del model, opt, step
        torch.cuda.empty_cache()
    if rank == 0:
        print(f"\n{world} x {torch.cuda.get_device_name(local)}, torch {torch.__version__}, "
              f"global batch {args.global_batch_size}, {args.steps} steps\n")
        print("| mode | params | how | samples/s | ms/step | peak GiB |\n|---|---|---|---|---|---|")
        print("\n".join(rows))
        print("\n".join(profiles))
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
