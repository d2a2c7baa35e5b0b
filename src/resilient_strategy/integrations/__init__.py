"""Hand a Selection to the training tools people already use: Lightning and Accelerate.

Each submodule imports its tool only when called (``pip install resilient-strategy[lightning]``
or ``[accelerate]``); importing this package imports neither, nor torch.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from ..errors import InvalidOptionError

if TYPE_CHECKING:
    from ..selection import Selection

#: What a launcher (torchrun, ``accelerate launch``) sets to describe the job to its processes.
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                 "ROLE_RANK", "ROLE_WORLD_SIZE", "GROUP_WORLD_SIZE", "TORCHELASTIC_RUN_ID")


def require_torch_selection(sel: Selection, tool: str) -> None:
    """The tool trains PyTorch: a TensorFlow selection is a typed error, not a crash later."""
    if sel.framework != "torch":
        raise InvalidOptionError(
            f"{tool} trains PyTorch models; this selection is for {sel.framework}. Call "
            "resilient_strategy(framework='torch', ...)")
    if sel.dry_run:
        raise InvalidOptionError(f"a dry-run selection cannot configure {tool}: nothing was proven")


def refuse_one_process_offload(sel: Selection, tool: str) -> None:
    """FSDP2 on one GPU with CPU offload is the Selection's own (``sel.prepare``): the tools'
    one-device strategies would hold the whole state on the GPU, which does not fit."""
    if sel.candidate.offload and sel.world_size == 1:
        raise InvalidOptionError(
            f"this selection trains FSDP on one GPU with its state offloaded to host memory; "
            f"{tool}'s one-device strategy would hold the whole state on the GPU, which does "
            "not fit. Train with sel.prepare(model, optimizer, loader), or start more processes "
            "so that the model shards", "offload")


def precision(sel: Selection) -> str:
    """The resolved policy of ``sel.precision``: "bf16", "fp16" or "fp32" (CPU: fp32 unless
    asked otherwise)."""
    from ..frameworks.torch import precision_policy

    cc: tuple[int, int] | None = None
    if sel.backend in ("nccl", "single_device") or (sel.backend == "gloo" and sel.devices):
        by_index = {g.index: g for g in sel.facts.gpus}
        gpu = by_index.get(sel.devices[0]) if sel.devices else None
        cc = gpu.compute_capability if gpu is not None else None
    dtype = precision_policy(sel.precision, cc).dtype
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[dtype]


def on_gpu(sel: Selection) -> bool:
    return sel.backend != "cpu" and bool(sel.devices)


def alone_under_launcher(sel: Selection) -> bool:
    """A launcher started several processes but the choice trains on this one alone."""
    return sel.launch.launched and sel.num_replicas == 1


@contextlib.contextmanager
def launcher_hidden(sel: Selection) -> Iterator[None]:
    """While a tool sets itself up, hide the launcher's variables when this process trains alone
    (a one-device fallback under torchrun): the tool would otherwise wait for peers that have
    left. They are restored on exit; nothing is hidden in any other case."""
    if not alone_under_launcher(sel):
        yield
        return
    saved = {k: os.environ.pop(k) for k in LAUNCHER_VARS if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)

