"""One srun task of tests/test_slurm.py: decide, train a few steps on CPU over gloo, and write
what this task saw as JSON to ``$OUT_DIR/rank-<rank>.json`` (SLURM_PROCID for srun python; the
rank `resilient-strategy run` gave it as a worker, with the launcher run saw).

``--described-gpus N``: decide through the testing kit on a described machine of N GPUs with
this task's real environment (SLURM's CUDA_VISIBLE_DEVICES per task), and write the binding
instead of training (the placeholders SLURM binds are not GPUs)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import resilient_strategy


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--global-batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--described-gpus", type=int, default=0)
    args = parser.parse_args()
    if args.described_gpus:
        out = Path(os.environ["OUT_DIR"]) / f"rank-{os.environ['SLURM_PROCID']}.json"
        from resilient_strategy.testing import machine, simulate

        env = dict(os.environ)
        sel = simulate(machine(args.described_gpus, env=env), {}, env=env,
                       global_batch_size=args.global_batch_size)
        events = sel.to_dict()["events"]
        out.write_text(json.dumps({
            "rank": sel.launch.rank, "world_size": sel.launch.world_size,
            "backend": sel.backend, "replicas": sel.num_replicas,
            "visible": env.get("CUDA_VISIBLE_DEVICES"), "bound_ordinal": sel.bound_ordinal,
            "events": [e for e in events if e["kind"] in ("launcher_seen", "gpus_bound")]}))
        return
    sel = resilient_strategy.resilient_strategy(
        framework="torch", global_batch_size=args.global_batch_size)
    import torch
    import torch.distributed as dist

    x = torch.arange(args.samples, dtype=torch.float32).unsqueeze(1)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x), drop_last=True,
                                         batch_size=sel.batch_size, shuffle=False)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    model, optimizer, loader = sel.prepare(model, optimizer, loader)
    seen: list[float] = []
    steps = 0
    for (batch,) in loader:
        seen += batch.flatten().tolist()
        with sel.accumulate(model):
            sel.backward(model(batch).sum())
        steps += sel.step(optimizer)
    together = torch.tensor([float(sel.launch.rank)])
    if dist.is_initialized():
        dist.all_reduce(together)
    events = sel.to_dict()["events"]
    [launcher] = [e for e in events if e["kind"] == "launcher_seen"]
    from resilient_strategy.records.handoff import load_decision

    handed = load_decision(dict(os.environ))  # a worker of `resilient-strategy run`: its decision
    # (srun python: one rank per task, SLURM_PROCID; under run: the rank run's agent gave it)
    out = Path(os.environ["OUT_DIR"]) / f"rank-{sel.launch.rank}.json"
    out.write_text(json.dumps({
        "rank": sel.launch.rank, "world_size": sel.launch.world_size, "backend": sel.backend,
        "replicas": sel.num_replicas, "per_replica_batch": sel.per_replica_batch_size,
        "accumulation": sel.accumulation_steps, "global_batch": sel.global_batch_size,
        "main": sel.is_main_process,
        "samples": seen, "steps": steps, "rank_sum": together.item(),
        "group": dist.get_world_size() if dist.is_initialized() else 0,
        "launcher": launcher, "run_launcher": None if handed is None else handed.launcher,
        "run_notes": [e.get("topic") for e in events if e["kind"] == "note"
                      and e.get("topic") == "run_launcher"]}))
    sel.shutdown()


if __name__ == "__main__":
    main()
