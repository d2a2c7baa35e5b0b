"""Train a small MLP with Lightning on whatever strategy resilient_strategy proves works.

    python examples/lightning_train.py                           # one device
    torchrun --nproc_per_node 2 examples/lightning_train.py      # DDP: NCCL if it works, else gloo
    RESILIENT_STRATEGY_PROBE_FAULT=exit:1 torchrun --nproc_per_node 2 examples/lightning_train.py

    resilient-strategy run --nproc-per-node 2 examples/lightning_train.py --checkpoint-dir ckpt

The third one breaks the collective probe on purpose: the selection falls back to one device with
2 accumulation steps (same global batch), and Lightning trains on that; rank 1 exits cleanly.
The last one is supervised: ``trainer_kwargs`` adds a callback that reports each optimizer step,
so a rank that hangs or fails mid-run is seen, and the job is relaunched (on the next strategy
when it repeats) and resumes from the last checkpoint (Lightning's ``ModelCheckpoint``, at each
epoch's end).
Needs ``pip install 'resilient-strategy[lightning]'``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import resilient_strategy

FEATURES, CLASSES = 32, 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--global-batch-size", type=int, default=256)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--checkpoint-dir", default=None,
                        help="checkpoint there at each epoch's end; resume from it")
    args = parser.parse_args()

    # Decide first: the selection sets its variables before Lightning touches CUDA.
    sel = resilient_strategy.resilient_strategy(framework="torch",
                                                global_batch_size=args.global_batch_size)
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from resilient_strategy.integrations.lightning import trainer_kwargs

    # at epoch ends: Lightning resumes a plain DataLoader exactly only there (from a mid-epoch
    # checkpoint it replays the epoch's remaining batches by index, which is another number of
    # steps once a relaunch trains on fewer processes)
    saves = [] if args.checkpoint_dir is None else [ModelCheckpoint(
        args.checkpoint_dir, save_last=True, save_top_k=1, every_n_epochs=1)]
    # yours go through trainer_kwargs: under `resilient-strategy run` it adds the progress one
    kwargs = trainer_kwargs(sel, callbacks=saves)  # an idle rank of a 1-device fallback exits
    import torch
    import torch.nn.functional as F

    class Classifier(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 128), torch.nn.GELU(),
                                           torch.nn.Linear(128, CLASSES))
            self.losses: list[float] = []

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.losses.append(float(loss.detach()))
            return loss

        def on_train_epoch_end(self) -> None:
            mean = sum(self.losses) / max(1, len(self.losses))
            sel.print(f"epoch {self.current_epoch + 1}: loss {mean:.4f} (rank 0), "
                      f"{self.trainer.global_step} optimizer steps")
            self.losses.clear()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.samples, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(dim=1)
    # sel.batch_size is this process's micro-batch; Lightning shards the data over the ranks
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                         batch_size=sel.batch_size, shuffle=True, drop_last=True)
    sel.print(f"Trainer(accelerator={kwargs['accelerator']!r}, devices={kwargs['devices']}, "
              f"strategy={type(kwargs['strategy']).__name__}, "
              f"accumulate_grad_batches={kwargs['accumulate_grad_batches']}, "
              f"precision={kwargs['precision']!r}); {sel.num_replicas} replica(s) x "
              f"{sel.batch_size} samples x {sel.accumulation_steps} accumulation step(s) = "
              f"global batch {sel.global_batch_size}")
    torch.manual_seed(0)
    trainer = L.Trainer(max_epochs=args.epochs, logger=False, enable_checkpointing=bool(saves),
                        enable_progress_bar=False, enable_model_summary=False, **kwargs)
    last = None if args.checkpoint_dir is None else Path(args.checkpoint_dir) / "last.ckpt"
    trainer.fit(Classifier(), loader, ckpt_path=last if last and last.exists() else None)
    sel.print(f"optimizer steps: {trainer.global_step}")


if __name__ == "__main__":
    main()
