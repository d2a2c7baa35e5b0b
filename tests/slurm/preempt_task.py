"""The script of tests/test_slurm.py's preemption test, under ``resilient-strategy run``:
trains ``--samples / --global-batch-size`` optimizer steps on CPU, slowly (``--step-s`` a
step, so that a signal lands mid-run), checkpointing only when the supervisor asks
(``every_steps`` beyond the run), and notes each step in ``$OUT_DIR/progress`` and, at the
end, the steps and where it resumed from in ``$OUT_DIR/done-<SLURM_RESTART_COUNT>.json``."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import resilient_strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch-size", type=int, default=4)
    parser.add_argument("--samples", type=int, default=80)
    parser.add_argument("--step-s", type=float, default=0.2)
    parser.add_argument("--checkpoint-dir", required=True)
    args = parser.parse_args()
    out = Path(os.environ["OUT_DIR"])
    import torch

    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=args.global_batch_size)
    x = torch.arange(args.samples, dtype=torch.float32).unsqueeze(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), drop_last=True,
                                         batch_size=sel.batch_size, shuffle=False)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    ckpt = sel.checkpoint(args.checkpoint_dir, every_steps=1_000_000)
    model, optimizer, loader = sel.prepare(model, optimizer, loader)
    for epoch in range(ckpt.epoch, 1):
        sel.set_epoch(epoch)
        for (batch,) in loader:
            with sel.accumulate(model):
                sel.backward(model(batch).sum())
            if sel.step(optimizer) and sel.is_main_process:
                (out / "progress").write_text(str(ckpt.optimizer_steps))
            time.sleep(args.step_s)  # the pace of a real step, so that a signal lands mid-run
    if sel.is_main_process:
        restart = os.environ.get("SLURM_RESTART_COUNT", "0")
        (out / f"done-{restart}.json").write_text(json.dumps({
            "steps": ckpt.optimizer_steps, "restored": ckpt.restored_step}))
    sel.shutdown()


if __name__ == "__main__":
    main()
