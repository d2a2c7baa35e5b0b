"""A tiny training job for the two-node tests, run by torchrun on each simulated node.

    torchrun --nnodes 2 ... tests/_two_node_job.py OUT_DIR

It records where it runs (OUT_DIR/start-<rank>.json: its node and torchrun's pid, before
deciding), what it decided (OUT_DIR/decision-<rank>.json: Selection.to_dict()), and what it
trained (OUT_DIR/trained-<rank>.json). A rank left idle exits 0 at scope().
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import resilient_strategy


def write(name: str, data: object) -> None:
    out = Path(sys.argv[1]) / f"{name}-{os.environ['RANK']}.json"
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(data), encoding="utf-8")
    os.replace(tmp, out)


def main() -> None:
    write("start", {"node": int(os.environ["GROUP_RANK"]), "agent_pid": os.getppid()})
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=64, gradient_bytes=40_000, sample_seconds=0.001)
    write("decision", sel.to_dict())
    import torch

    with sel.scope():  # a rank the decision leaves idle exits 0 here
        model = torch.nn.Linear(8, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, _ = sel.prepare(model, opt)
    steps = 0
    g = torch.Generator().manual_seed(int(os.environ["RANK"]))
    for _ in range(2 * sel.accumulation_steps):
        with sel.accumulate(model):
            sel.backward(model(torch.randn(sel.batch_size, 8, generator=g)).pow(2).mean())
        steps += sel.step(opt)
    weights = [float(x) for x in model.parameters().__next__().detach().flatten()[:4]]
    sel.shutdown()
    write("trained", {"optimizer_steps": steps, "weights": weights})


if __name__ == "__main__":
    main()
