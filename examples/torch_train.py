"""Train a small MLP classifier with PyTorch on whatever strategy resilient_strategy proves works.

    python examples/torch_train.py                           # one device (accumulating if needed)
    torchrun --nproc_per_node 2 examples/torch_train.py      # DDP: NCCL if it works, else gloo
    torchrun --nnodes 2 --nproc-per-node 1 --rdzv-backend c10d --rdzv-endpoint HOST:29400 \
        examples/torch_train.py                              # on each node: proven across nodes
    resilient-strategy run --nproc-per-node 2 examples/torch_train.py --checkpoint-dir ckpt
                                                  # supervised: relaunched on the next strategy
                                                  # when a collective fails or stalls mid-run

On a machine without GPUs, torchrun runs 2 CPU processes over gloo (how CI runs it). Importing
torch earlier would be fine too, as long as nothing touches a GPU before the selection (CUDA reads
CUDA_VISIBLE_DEVICES when it first starts); importing it after is the habit that cannot go wrong.
"""

from __future__ import annotations

import argparse
import time

import resilient_strategy

FEATURES, CLASSES = 32, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--hidden", type=int, default=256, help="width (4096 on GPUs: ~100M params)")
    parser.add_argument("--depth", type=int, default=2, help="hidden layers (6 on GPUs)")
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint there; resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="optimizer steps")
    args = parser.parse_args()

    params = FEATURES * args.hidden + (args.depth - 1) * args.hidden**2 + args.hidden * CLASSES
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=args.global_batch_size,
        gradient_bytes=4 * params,  # fp32 gradients: lets it rank strategies by speed
    )
    sel.print(sel.summary())  # rank 0 only: one line (sel.explain() says why)
    if not sel.active:  # a one-device fallback under torchrun: only rank 0 trains
        return

    import torch
    import torch.nn.functional as F

    # Every rank builds the same data (same seed); the sampler gives each its shard.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g) + 0.5 * torch.randn(
        args.samples, CLASSES, generator=g)).argmax(dim=1)
    on_gpu = sel.device.type == "cuda"
    if on_gpu:
        # On GPUs the data lives on the device and the loader draws only indices (its sampler
        # still shards, shuffles and resumes them), so samples/s measures the model and the
        # strategy, not a CPU DataLoader collating a batch every step.
        x, y = x.to(sel.device), y.to(sel.device)
    loader = torch.utils.data.DataLoader(
        range(args.samples) if on_gpu else torch.utils.data.TensorDataset(x, y),
        batch_size=sel.batch_size, shuffle=True, drop_last=True,
    )

    torch.manual_seed(0)
    with sel.scope():  # builds on this rank's device
        layers: list[torch.nn.Module] = [torch.nn.Linear(FEATURES, args.hidden), torch.nn.GELU()]
        for _ in range(args.depth - 1):
            layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.GELU()]
        model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # before prepare(): prepare() restores the last checkpoint (any replica count)
    ckpt = sel.checkpoint(args.checkpoint_dir, every_steps=args.checkpoint_every) \
        if args.checkpoint_dir else None
    model, optimizer, loader = sel.prepare(model, optimizer, loader)  # DDP + DistributedSampler
    if ckpt is not None and ckpt.restored_step is not None:
        sel.print(f"resumed from {ckpt.path} at optimizer step {ckpt.restored_step}")
    sel.print(
        f"{sel.num_replicas} replica(s) x {sel.per_replica_batch_size} samples x "
        f"{sel.accumulation_steps} accumulation step(s) = global batch {sel.global_batch_size}"
    )

    for epoch in range(ckpt.epoch if ckpt else 0, args.epochs):
        sel.set_epoch(epoch)
        start, total, batches, updates = time.perf_counter(), 0.0, 0, 0
        for batch in loader:
            if on_gpu:  # a batch of indices into the data on the device
                idx = batch.to(sel.device, non_blocking=True)
                xb, yb = x[idx], y[idx]
            else:
                xb, yb = batch[0].to(sel.device), batch[1].to(sel.device)
            with sel.accumulate(model):  # no gradient all-reduce until the last micro-step
                with sel.autocast():
                    loss = F.cross_entropy(model(xb), yb)
                sel.backward(loss)
            updates += sel.step(optimizer)
            total, batches = total + loss.item(), batches + 1
        seconds = time.perf_counter() - start
        samples = batches * (sel.batch_size or 0) * sel.num_replicas  # all replicas together
        if batches:
            sel.print(
                f"epoch {epoch + 1}: loss {total / batches:.4f} (rank 0), {updates} optimizer "
                f"steps, {samples / seconds:,.0f} samples/s"
            )
    if ckpt is not None:
        ckpt.save()  # the final state (rank 0)
    sel.print(f"optimizer steps: {sel.optimizer_steps}")
    sel.shutdown()


if __name__ == "__main__":
    main()
