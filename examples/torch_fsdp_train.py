"""Train a model sharded over the processes (PyTorch FSDP2) on the backend resilient_strategy proves.

    python examples/torch_fsdp_train.py                         # one process: nothing to shard
    torchrun --nproc_per_node 2 examples/torch_fsdp_train.py    # FSDP2 over NCCL, else gloo
    torchrun --nproc_per_node 2 examples/torch_fsdp_train.py --checkpoint-dir ckpt --epochs 1
    torchrun --nproc_per_node 1 examples/torch_fsdp_train.py --checkpoint-dir ckpt --epochs 2
                                  # resumes the sharded checkpoint on another number of processes
    resilient-strategy run --nproc-per-node 2 --sharding full examples/torch_fsdp_train.py \
        --checkpoint-dir ckpt       # run plans with the script's sharding: say it (--sharding)

``--sharding full`` (the default here) always shards; ``auto`` shards only when a replica of the
model (parameters, gradients, AdamW's state) does not fit the GPUs' free memory, which on a CPU
machine is never known, so it replicates (DDP). The model is a stack of residual blocks:
``prepare`` shards each block, then the root (``--shard-modules`` is the default anyway; it
shows how to name the unit class). Checkpoints go through torch.distributed.checkpoint: every
rank writes its shards, and a relaunch on another number of processes reshards them on load.
"""

from __future__ import annotations

import argparse
import time

import resilient_strategy

FEATURES, CLASSES = 32, 10


def build_model(hidden: int, depth: int) -> object:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(hidden)
            self.up = torch.nn.Linear(hidden, 4 * hidden)
            self.down = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Linear(FEATURES, hidden)
            self.blocks = torch.nn.ModuleList(Block() for _ in range(depth))
            self.head = torch.nn.Linear(hidden, CLASSES)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = self.embed(x)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    return Net()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--depth", type=int, default=4, help="residual blocks (sharding units)")
    parser.add_argument("--sharding", default="full", choices=("auto", "full", "none"))
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint there; resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="optimizer steps")
    args = parser.parse_args()

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = build_model(args.hidden, args.depth)  # on the CPU: nothing touches a GPU yet
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=args.global_batch_size, model=model,
        sharding=args.sharding, optimizer_state_factor=2.0,  # AdamW: two moments per parameter
    )
    sel.print(sel.summary())  # one line (sel.explain() says why)
    if not sel.active:
        return

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    on_gpu = sel.device.type == "cuda"
    if on_gpu:  # the data on the device, the loader drawing indices (as examples/torch_train.py)
        x, y = x.to(sel.device), y.to(sel.device)
    loader = torch.utils.data.DataLoader(
        range(args.samples) if on_gpu else torch.utils.data.TensorDataset(x, y),
        batch_size=sel.batch_size, shuffle=True, drop_last=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # type: ignore[attr-defined]
    ckpt = sel.checkpoint(args.checkpoint_dir, every_steps=args.checkpoint_every) \
        if args.checkpoint_dir else None
    block = type(model.blocks[0])  # type: ignore[attr-defined]
    model, optimizer, loader = sel.prepare(model, optimizer, loader, shard_modules=[block])
    if ckpt is not None and ckpt.restored_step is not None:
        sel.print(f"resumed at optimizer step {ckpt.restored_step}")
    sel.print(f"{'sharded (FSDP2)' if sel.sharded else 'replicated'}: {sel.num_replicas} "
              f"replica(s) x {sel.per_replica_batch_size} x {sel.accumulation_steps} "
              f"accumulation step(s) = global batch {sel.global_batch_size}")

    for epoch in range(ckpt.epoch if ckpt else 0, args.epochs):
        sel.set_epoch(epoch)
        start, total, batches = time.perf_counter(), 0.0, 0
        for batch in loader:
            if on_gpu:  # a batch of indices into the data on the device
                idx = batch.to(sel.device, non_blocking=True)
                xb, yb = x[idx], y[idx]
            else:
                xb, yb = batch[0].to(sel.device), batch[1].to(sel.device)
            with sel.accumulate(model):  # no reduce-scatter until the last micro-step
                with sel.autocast():
                    loss = F.cross_entropy(model(xb), yb)
                sel.backward(loss)
            sel.step(optimizer)
            total, batches = total + loss.item(), batches + 1
        if batches:
            rate = batches * (sel.batch_size or 0) * sel.num_replicas / (time.perf_counter() - start)
            sel.print(f"epoch {epoch + 1}: loss {total / batches:.4f} (rank 0), {rate:,.0f} "
                      "samples/s")
    if ckpt is not None:
        ckpt.save()  # every rank: a sharded checkpoint is written by all of them
    sel.print(f"optimizer steps: {sel.optimizer_steps}")
    sel.shutdown()


if __name__ == "__main__":
    main()
