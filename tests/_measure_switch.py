"""Run under ``resilient-strategy run`` by tests/test_measured_switch.py: a communication-heavy
step (a 32 MiB table all-reduced each step for almost no compute, one sample per replica), the
library's loop until ``STEPS`` optimizer steps, checkpointed every 5 steps with ``CKPT`` (a
directory; "-": none). Rank 0 appends ``{"attempt", "steps", "candidate"}`` to ``OUT`` at the
end of each attempt that finished.

    resilient-strategy run --nproc-per-node 2 tests/_measure_switch.py OUT STEPS CKPT
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import resilient_strategy


def main() -> None:
    out, steps, ckpt_dir = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=2, precision="fp32")
    if not sel.active:
        return
    import torch
    import torch.nn.functional as F

    class Table(torch.nn.Module):
        """A small head and a 32 MiB table of which one value is read (times 0): DDP
        all-reduces the whole table's gradient each step, the compute is the head's."""

        def __init__(self) -> None:
            super().__init__()
            self.table = torch.nn.Parameter(torch.zeros(8 << 20))  # first: all-reduced last
            self.head = torch.nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x) + 0.0 * self.table[:1]

    torch.manual_seed(0)
    model = Table()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    if ckpt_dir != "-":
        sel.checkpoint(ckpt_dir, every_steps=5, asynchronous=False)
    model, opt, _ = sel.prepare(model, opt)
    batch = sel.per_replica_batch_size or 1
    x, y = torch.randn(batch, 64), torch.randn(batch, 4)
    while sel.optimizer_steps < steps:
        with sel.accumulate(model):
            sel.backward(F.mse_loss(model(x), y))
        sel.step(opt)
    if sel.is_main_process:
        with out.open("a", encoding="utf-8") as f:
            f.write(json.dumps({"attempt": os.environ.get("RESILIENT_STRATEGY_ATTEMPT", ""),
                                "steps": sel.optimizer_steps,
                                "candidate": sel.candidate.key}) + "\n")
    sel.shutdown()


if __name__ == "__main__":
    main()
