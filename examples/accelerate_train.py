"""Train a small MLP with Hugging Face Accelerate on whatever strategy resilient_strategy proves.

    python examples/accelerate_train.py                          # one device
    torchrun --nproc_per_node 2 examples/accelerate_train.py     # or: accelerate launch ...
    RESILIENT_STRATEGY_PROBE_FAULT=exit:1 torchrun --nproc_per_node 2 examples/accelerate_train.py

    resilient-strategy run --nproc-per-node 2 examples/accelerate_train.py --checkpoint-dir ckpt

The third one breaks the collective probe on purpose: the selection falls back to one device with
2 accumulation steps (same global batch), and Accelerate trains on that; rank 1 exits cleanly.
The last one is supervised: ``make_accelerator`` has the accelerator report each optimizer step,
so a rank that hangs or fails mid-run is seen, and the job is relaunched (on the next strategy
when it repeats) and resumes from the last ``accelerator.save_state`` checkpoint.
Needs ``pip install 'resilient-strategy[accelerate]'``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import resilient_strategy

FEATURES, CLASSES = 32, 10


class Progress:
    """The optimizer steps taken, saved and restored with the accelerator's state."""

    def __init__(self) -> None:
        self.steps = 0

    def state_dict(self) -> dict[str, int]:
        return {"steps": self.steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.steps = int(state["steps"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--checkpoint-dir", default=None, help="checkpoint there; resume from it")
    parser.add_argument("--checkpoint-every", type=int, default=50, help="optimizer steps")
    args = parser.parse_args()

    # Decide first: the selection sets its variables before anything touches CUDA.
    sel = resilient_strategy.resilient_strategy(framework="torch",
                                                global_batch_size=args.global_batch_size)
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
    # resume: the optimizer steps taken are saved with the state (a custom checkpointed object)
    progress = Progress()
    accelerator.register_for_checkpointing(progress)
    if args.checkpoint_dir and Path(args.checkpoint_dir).is_dir():
        accelerator.load_state(args.checkpoint_dir)
        accelerator.print(f"resumed from {args.checkpoint_dir} at optimizer step {progress.steps}")
    per_epoch = len(loader) // accelerator.gradient_accumulation_steps  # optimizer steps
    for epoch in range(progress.steps // per_epoch, args.epochs):
        total, batches = 0.0, 0
        done = progress.steps - epoch * per_epoch  # steps of this epoch already taken
        batches_left = accelerator.skip_first_batches(
            loader, done * accelerator.gradient_accumulation_steps) if done else loader
        for xb, yb in batches_left:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(xb), yb)
                accelerator.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
            total, batches = total + float(loss.detach()), batches + 1
            if accelerator.sync_gradients:
                progress.steps += 1
                if args.checkpoint_dir and progress.steps % args.checkpoint_every == 0:
                    accelerator.save_state(args.checkpoint_dir)
        accelerator.print(f"epoch {epoch + 1}: loss {total / max(1, batches):.4f} (rank 0), "
                          f"{progress.steps} optimizer steps")
    accelerator.print(f"optimizer steps: {progress.steps}")
    # a barrier, then the process group destroyed (accelerator.end_training() destroys it
    # without the barrier; use it too when you have trackers to finish)
    sel.shutdown()


if __name__ == "__main__":
    main()
