"""A loop of its own (tests/test_adopt.py) under torchrun on 2 processes, for a global batch of 32
with at most ``argv[1]`` samples per micro-batch: 16 trains without accumulating, 8 accumulates
two micro-batches per optimizer step on each rank. Rank 0 writes the accumulation, the
optimizer steps, DDP's gradient sync per forward and the weights to ``argv[2]``."""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import resilient_strategy

sel = resilient_strategy.resilient_strategy(
    framework="torch", global_batch_size=32, max_per_replica_batch=int(sys.argv[1])
).init_process_group()
g = torch.Generator().manual_seed(1)
data = TensorDataset(torch.randn(100, 3, generator=g), torch.randn(100, 1, generator=g))
loader = DataLoader(data, batch_size=sel.batch_size, sampler=DistributedSampler(data, shuffle=False))
torch.manual_seed(0)
model = torch.nn.Linear(3, 1)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model, opt = sel.adopt(model, opt, loader)
syncs = []
model.register_forward_pre_hook(lambda m, a: syncs.append(m.require_backward_grad_sync))
for epoch in range(2):
    loader.sampler.set_epoch(epoch)
    for x, y in loader:
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
if dist.get_rank() == 0:
    with open(sys.argv[2], "w") as fh:
        json.dump({"accumulation": sel.accumulation_steps, "steps": sel.optimizer_steps,
                   "syncs": syncs, "weight": model.module.weight.tolist()}, fh)
dist.destroy_process_group()
