"""The nanoGPT-shaped script of ``original.py``, adopted as docs/how-to/adopt-ddp.md says.

Our own code (see ``original.py``: in the shape of karpathy/nanoGPT ``train.py``, MIT), with the
adoption's lines: the import; ``sel = ...init_process_group()`` (the global batch of one
iteration) instead of ``init_process_group(backend=backend)``; the world size from the
decision's group (1 on a one-process fallback, where torchrun's ``WORLD_SIZE`` still says 2);
``sel.adopt(model, optimizer, accumulates=True)`` instead of ``DDP(...)`` (the loop accumulates
itself). Marked ``# resume under run``: resume from ``ckpt.pt`` when it exists and report its
iteration with ``sel.resumed_from``.

    resilient-strategy run --nproc-per-node 2 adopted.py --device=cpu --backend=gloo ...
"""
# (end of header)
import math
import os
import pickle
from contextlib import nullcontext

import numpy as np
import torch
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP

from model import GPT, GPTConfig
import resilient_strategy

# ----- settings (each overridable: --key=value) -----
out_dir, init_from = 'out', 'scratch'  # init_from: 'scratch' or 'resume' (out_dir/ckpt.pt)
eval_interval, eval_iters, log_interval = 100, 10, 10
dataset = 'synthetic'
gradient_accumulation_steps, batch_size, block_size = 8, 8, 64
n_layer, n_head, n_embd, dropout, bias = 2, 2, 32, 0.0, False
learning_rate, min_lr, warmup_iters, max_iters = 1e-3, 1e-4, 10, 1000
weight_decay, beta1, beta2, grad_clip = 0.1, 0.9, 0.95, 1.0
backend, device, compile = 'nccl', 'cuda', True
dtype = 'bfloat16'  # 'float32', 'bfloat16' or 'float16' (the GradScaler)
settings = [k for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))]
exec(open('configurator.py').read())
config = {k: globals()[k] for k in settings}
init_from = 'resume' if os.path.exists(os.path.join(out_dir, 'ckpt.pt')) else init_from  # resume under run

# ----- one process or DDP -----
ddp = int(os.environ.get('RANK', -1)) != -1
if ddp:
    sel = resilient_strategy.resilient_strategy(framework='torch', global_batch_size=gradient_accumulation_steps * batch_size).init_process_group()
    ddp_rank = int(os.environ['RANK'])
    ddp_local_rank = int(os.environ['LOCAL_RANK'])
    ddp_world_size = torch.distributed.get_world_size()
    if device.startswith('cuda'):
        device = f'cuda:{ddp_local_rank}'
        torch.cuda.set_device(device)
    master_process = ddp_rank == 0
    seed_offset = ddp_rank
    assert gradient_accumulation_steps % ddp_world_size == 0
    gradient_accumulation_steps //= ddp_world_size
else:
    master_process, seed_offset, ddp_world_size = True, 0, 1
if master_process:
    os.makedirs(out_dir, exist_ok=True)
torch.manual_seed(100 + seed_offset)
device_type = 'cuda' if 'cuda' in device else 'cpu'
ctx = nullcontext() if device_type == 'cpu' else torch.autocast(device_type, dtype=getattr(torch, dtype))

data_dir = os.path.join('data', dataset)
def get_batch(split):
    tokens = np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')
    starts = torch.randint(len(tokens) - block_size, (batch_size,))
    x = torch.stack([torch.from_numpy(tokens[i:i + block_size].astype(np.int64)) for i in starts])
    y = torch.stack([torch.from_numpy(tokens[i + 1:i + 1 + block_size].astype(np.int64)) for i in starts])
    return x.to(device), y.to(device)

# ----- the model, from scratch or from out_dir/ckpt.pt -----
iter_num, best_val_loss = 0, 1e9
with open(os.path.join(data_dir, 'meta.pkl'), 'rb') as f:
    vocab_size = pickle.load(f)['vocab_size']
model_args = dict(n_layer=n_layer, n_head=n_head, n_embd=n_embd, block_size=block_size, bias=bias, vocab_size=vocab_size, dropout=dropout)
if init_from == 'resume':
    checkpoint = torch.load(os.path.join(out_dir, 'ckpt.pt'), map_location=device)
    model_args.update(checkpoint['model_args'])
model = GPT(GPTConfig(**model_args))
if init_from == 'resume':
    model.load_state_dict(checkpoint['model'])
    iter_num, best_val_loss = checkpoint['iter_num'], checkpoint['best_val_loss']
    print(f"resuming from iteration {iter_num}")
    if ddp: sel.resumed_from(iter_num)  # resume under run
model.to(device)
scaler = torch.amp.GradScaler(device_type, enabled=(dtype == 'float16'))
optimizer = model.configure_optimizers(weight_decay, learning_rate, (beta1, beta2), device_type)
if init_from == 'resume':
    optimizer.load_state_dict(checkpoint['optimizer'])
if compile:
    model = torch.compile(model)
if ddp:
    model, optimizer = sel.adopt(model, optimizer, accumulates=True)
raw_model = model.module if ddp else model

@torch.no_grad()
def estimate_loss():
    model.eval()
    losses = {}
    for split in ('train', 'val'):
        values = torch.zeros(eval_iters)
        for k in range(eval_iters):
            x, y = get_batch(split)
            with ctx:
                values[k] = model(x, y)[1].item()
        losses[split] = values.mean().item()
    model.train()
    return losses

def get_lr(it):
    if it < warmup_iters:
        return learning_rate * (it + 1) / warmup_iters
    progress = min(1.0, (it - warmup_iters) / max(1, max_iters - warmup_iters))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (learning_rate - min_lr)

# ----- the loop -----
X, Y = get_batch('train')
while True:
    for group in optimizer.param_groups:
        group['lr'] = get_lr(iter_num)
    if iter_num % eval_interval == 0 and master_process:
        losses = estimate_loss()
        print(f"iteration {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        best_val_loss = min(best_val_loss, losses['val'])
        if iter_num > 0:
            torch.save({'model': raw_model.state_dict(), 'optimizer': optimizer.state_dict(), 'model_args': model_args,
                        'iter_num': iter_num, 'best_val_loss': best_val_loss, 'config': config},
                       os.path.join(out_dir, 'ckpt.pt'))
    for micro_step in range(gradient_accumulation_steps):
        if ddp:
            model.require_backward_grad_sync = micro_step == gradient_accumulation_steps - 1
        with ctx:
            loss = model(X, Y)[1] / gradient_accumulation_steps
        X, Y = get_batch('train')
        scaler.scale(loss).backward()
    if grad_clip:
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    scaler.step(optimizer)
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    iter_num += 1
    if iter_num % log_interval == 0 and master_process:
        print(f"iteration {iter_num}: loss {loss.item() * gradient_accumulation_steps:.4f}")
    if iter_num > max_iters:
        break

if ddp:
    destroy_process_group()
