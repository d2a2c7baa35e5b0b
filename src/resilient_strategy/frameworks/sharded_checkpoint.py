"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), for FSDP2 models.

`checkpoint.Checkpointer` keeps one interface: it saves here when the model is sharded
(every rank writes its own shards, in parallel) and restores from here whenever the newest
checkpoint in its directory is a sharded one, into whatever the relaunch trains: FSDP2 over
another number of processes (DCP reshards on load), or one process with a plain module (DCP
loads without a process group then). The rest of the state (epoch, position in the epoch,
optimizer steps, GradScaler, RNG) is the same dictionary the replicated checkpoint holds, written
by rank 0 beside the shards.

Layout under the checkpoint directory::

    sharded/step-000000100/   DCP's files (.metadata, __<rank>_0.distcp) and meta.pt
    sharded/latest            the name of the last complete step directory (atomic rename)

A step directory is named in ``latest`` only after every rank finished writing it (a barrier),
so a crash mid-save leaves the previous checkpoint in force; the two newest are kept.
torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

from ..errors import InvalidOptionError

__all__ = ["DIR_NAME", "latest", "load", "newest_is_sharded", "save"]

DIR_NAME = "sharded"
LATEST = "latest"
META = "meta.pt"
KEEP = 2
_STEP = re.compile(r"step-\d{9,}")


def latest(directory: Path) -> Path | None:
    """The last complete sharded checkpoint under ``directory``, or None."""
    pointer = directory / DIR_NAME / LATEST
    try:
        name = pointer.read_text(encoding="utf-8").strip()
    except OSError:
        return None
    if not _STEP.fullmatch(name):
        raise InvalidOptionError(f"{pointer} names {name!r}, not a step directory")
    step = directory / DIR_NAME / name
    return step if (step / META).is_file() else None


def newest_is_sharded(directory: Path, plain: Path) -> bool:
    """Whether the newest checkpoint in ``directory`` is a sharded one (rather than ``plain``)."""
    pointer = directory / DIR_NAME / LATEST
    if latest(directory) is None:
        return False
    try:
        return pointer.stat().st_mtime >= plain.stat().st_mtime
    except FileNotFoundError:
        return True


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _state_dicts(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optimizer": optim_sd if optimizer is not None else {}}


def save(directory: Path, model: Any, optimizer: Any, meta: dict[str, Any], rank: int) -> Path:
    """Every rank writes its shards of the model and optimizer (a collective); rank 0 writes
    ``meta`` (the rest of the training state) and then points ``latest`` at the new step."""
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    root = directory / DIR_NAME
    step = root / f"step-{int(meta.get('optimizer_steps', 0)):09d}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if step.exists():  # a save at the same step that did not finish: start it afresh
            shutil.rmtree(step)
    _barrier()
    with warnings.catch_warnings():  # one process saving (a model sharded over one)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save(_state_dicts(model, optimizer), checkpoint_id=str(step))
    if rank == 0:
        _write_atomic(step / META, lambda fh: torch.save(meta, fh))
    _barrier()  # every rank's shards and the meta are written: now the step is complete
    if rank == 0:
        _write_atomic(root / LATEST, lambda fh: fh.write(step.name.encode()))
        _prune(root, keep=step.name)
    return step


def load(directory: Path, model: Any, optimizer: Any) -> dict[str, Any] | None:
    """Load the newest sharded checkpoint into ``model`` and ``optimizer`` (sharded or not, any
    world size) and return the rest of its state, or None when there is none."""
    step = latest(directory)
    if step is None:
        return None
    import torch
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    wanted = _state_dicts(model, optimizer)
    if optimizer is None:
        wanted.pop("optimizer")
    with warnings.catch_warnings():  # one process loading: what we mean, said once here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_load(wanted, checkpoint_id=str(step))
    set_state_dict(model, [optimizer] if optimizer is not None else [],
                   model_state_dict=wanted["model"],
                   optim_state_dict=wanted.get("optimizer", {}))
    meta: dict[str, Any] = torch.load(step / META, map_location="cpu", weights_only=True)
    return {**meta, "model": None, "optimizer": None}


def _write_atomic(path: Path, write: Any) -> None:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            write(fh)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _prune(root: Path, keep: str) -> None:
    steps = sorted(p.name for p in root.iterdir() if p.is_dir() and _STEP.fullmatch(p.name))
    for name in steps[:-KEEP]:
        if name != keep:
            shutil.rmtree(root / name, ignore_errors=True)
