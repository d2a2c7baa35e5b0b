"""Run under torchrun by tests/test_step_measure.py: train a few dozen optimizer steps through
the library and write each rank's ``sel.to_dict()`` to ``OUT/rank<r>.json``.

    python -m torch.distributed.run --nproc_per_node 2 tests/_measure_step.py OUT MODE STEPS

MODE ``light``: a small MLP through sel.prepare / sel.step; ``heavy``: a 32 MiB table besides
a small head (32 MiB all-reduced a step, almost no compute), one sample per rank,
through sel.adopt, the script's own loop (the all-reduce dominant).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import resilient_strategy


def main() -> None:
    out, mode, steps = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    heavy = mode == "heavy"
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=2 if heavy else 64, precision="fp32")
    if not sel.active:
        return
    import torch
    import torch.nn.functional as F

    class Table(torch.nn.Module):
        """A small head and a 32 MiB table no sample reads: DDP (find_unused_parameters)
        all-reduces 32 MiB of its bucket each step for almost no compute."""

        def __init__(self) -> None:
            super().__init__()
            # first: DDP buckets in reverse, so the table's all-reduce is launched last and
            # nothing of backward overlaps it (the step waits for all of it)
            self.table = torch.nn.Parameter(torch.zeros(8 << 20))
            self.head = torch.nn.Linear(64, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(x)  # the table unused: DDP all-reduces its zeroed bucket

    torch.manual_seed(0)
    model = Table() if heavy else torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = sel.per_replica_batch_size or 1
    x = torch.randn(batch, 64)
    y = torch.randn(batch, 4)
    if heavy:
        model, opt = sel.adopt(model, opt, find_unused_parameters=True)
        for _ in range(steps * sel.accumulation_steps):
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            opt.step()
    else:
        model, opt, _ = sel.prepare(model, opt)
        while sel.optimizer_steps < steps:
            with sel.accumulate(model):
                sel.backward(F.mse_loss(model(x), y))
            sel.step(opt)
    (out / f"rank{sel.rank}.json").write_text(json.dumps(sel.to_dict()), encoding="utf-8")
    sel.shutdown()


if __name__ == "__main__":
    main()
