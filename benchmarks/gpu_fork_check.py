"""On a GPU machine: may a decision fork its probe workers from the caller after ``import torch``
(libcuda loaded, not started), and is it refused once CUDA started? Prints one line each; a
forked child then initialises CUDA on GPU 0 and exits 0 (the proof that the fork was fit)."""

import os
import sys

import torch
import torch.distributed

from resilient_strategy.probing import forkserver as f


def child_uses_cuda() -> int:
    pid = os.fork()
    if pid == 0:
        try:
            import torch as t
            t.zeros(1, device="cuda:0").sum().item()
            os._exit(0)
        except BaseException as exc:
            os.write(2, f"child: {exc}\n".encode())
            os._exit(1)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


print("after import torch:", repr(f.why_not_here()), "child exit", child_uses_cuda(), flush=True)
torch.cuda.device_count()
print("after device_count():", repr(f.why_not_here()), flush=True)
torch.cuda.is_available()
print("after is_available():", repr(f.why_not_here()), "child exit", child_uses_cuda(), flush=True)
sys.exit(0)
