"""Train a small MLP with Hugging Face Accelerate on whatever strategy resilient_strategy proves.

    python examples/accelerate_train.py                          # one device
    torchrun --nproc_per_node 2 examples/accelerate_train.py     # or: accelerate launch ...
    RESILIENT_STRATEGY_PROBE_FAULT=exit:1 torchrun --nproc_per_node 2 examples/accelerate_train.py

The last one breaks the collective probe on purpose: the selection falls back to one device with
2 accumulation steps (same global batch), and Accelerate trains on that; rank 1 exits cleanly.
Needs ``pip install 'resilient-strategy[accelerate]'``.
"""

from __future__ import annotations

import argparse

import resilient_strategy

FEATURES, CLASSES = 32, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    args = parser.parse_args()

    # Decide first: the selection sets its variables before anything touches CUDA.
    sel = resilient_strategy.resilient_strategy(framework="torch",
                                                global_batch_size=args.global_batch_size)
    sel.print(sel.explain())  # rank 0 only
    from resilient_strategy.integrations.accelerate import make_accelerator

    accelerator = make_accelerator(sel)  # an idle rank of a one-device fallback exits here

    import torch
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    # sel.batch_size is this process's micro-batch; accelerator.prepare shards the data
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=sel.batch_size, shuffle=True, drop_last=True)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.GELU(),
                                torch.nn.Linear(128, CLASSES))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    accelerator.print(
        f"Accelerator: {accelerator.num_processes} process(es), {accelerator.distributed_type}, "
        f"gradient_accumulation_steps={accelerator.gradient_accumulation_steps}, "
        f"mixed_precision={accelerator.mixed_precision!r}; {sel.num_replicas} replica(s) x "
        f"{sel.batch_size} samples x {sel.accumulation_steps} accumulation step(s) = global "
        f"batch {sel.global_batch_size}")
    updates = 0
    for epoch in range(args.epochs):
        total, batches = 0.0, 0
        for xb, yb in loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
                updates += accelerator.sync_gradients
            total, batches = total + float(loss.detach()), batches + 1
        accelerator.print(f"epoch {epoch + 1}: loss {total / batches:.4f} (rank 0), {updates} "
                          "optimizer steps")
    # a barrier, then the process group destroyed (accelerator.end_training() destroys it
    # without the barrier; use it too when you have trackers to finish)
    sel.shutdown()


if __name__ == "__main__":
    main()
