"""The end of a PyTorch process group: a barrier, then ``destroy_process_group``, also at exit.

A script that forgets ``sel.shutdown()`` (or ends with Accelerate's ``end_training()``, which
destroys the group without a barrier) could abort after training finished: a gloo group torn
down while a peer is still mid-teardown, or freed during interpreter finalization, aborts with
"terminate called without an active exception" (pytorch/pytorch#179291), so the job exits 1
although every step ran. `end_at_exit` registers, once per process, an ``atexit`` hook that
ends any group still up while Python is fully alive: every rank meets in a barrier bounded by
`EXIT_BARRIER_S` (a rank that died leaves its peers waiting that long at most), then the
group is destroyed and garbage collected. After an uncaught exception (``sys.last_value`` is set
before ``atexit`` runs), or once the process said it failed (`skip_exit_barrier`), the
barrier is skipped: the peers may never come.

torch is imported only when a group is up (``torch.distributed`` already imported).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import sys
from datetime import timedelta

from ..process import PROCESS
from . import checkpoint_writer

#: The longest the exit barrier waits for the other ranks.
EXIT_BARRIER_S = 30.0
#: Process-wide by nature: the exit hook is registered once per process (`atexit`).
_REGISTERED: list[bool] = PROCESS.hold(
    "frameworks.teardown.registered", list, "whether the exit hook is registered")
#: Process-wide by nature: garbage was collected after the last group ended here, and no group
#: began since (the exit then has nothing of a group left to free: one full collection with
#: torch imported costs 0.08 s on a CPU and more with CUDA, and it ran three times per exit).
_COLLECTED: list[bool] = PROCESS.hold(
    "frameworks.teardown.collected", list, "garbage collected since the last group ended")


def end_process_group(barrier_s: float | None = EXIT_BARRIER_S) -> bool:
    """End the default process group if one is up: a barrier of at most ``barrier_s`` seconds
    (None: no barrier), then destroy it. Returns whether a group was ended. Never raises for a
    peer that is gone. A checkpoint write in flight ends first (`checkpoint_writer.WAIT_S` at
    most; without a barrier, the peers may be gone: not a sharded write, whose collectives need
    them)."""
    checkpoint_writer.wait_all(collective=barrier_s is not None)
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        if not _COLLECTED:
            gc.collect()
        return False
    if barrier_s is not None:
        with contextlib.suppress(Exception):
            work = dist.barrier(async_op=True)
            work.wait(timeout=timedelta(seconds=barrier_s))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
    gc.collect()  # free whatever may still hold the group while Python is fully alive
    _COLLECTED[:] = [True]
    return True


#: Process-wide by nature: whether this process raised (read by the exit hook, at exit).
_FAILED: list[bool] = PROCESS.hold(
    "frameworks.teardown.failed", list, "whether this process said it failed")


def process_group_error() -> str | None:
    """The default process group's own error state, as its backend reports it
    (``Backend.get_error()``: ``COMM_ERROR``, ``REMOTE_ERROR``, ``TIMEOUT``; torch's NCCL backend
    has it, gloo does not), or None: no group, no such state, or ``SUCCESS``. Never raises."""
    dist = sys.modules.get("torch.distributed")
    if dist is None:
        return None
    with contextlib.suppress(Exception):
        if not (dist.is_available() and dist.is_initialized()):
            return None
        torch = sys.modules["torch"]
        group = dist.group.WORLD
        for device in ("cuda", "cpu"):
            with contextlib.suppress(Exception):
                state = group._get_backend(torch.device(device)).get_error()
                name = str(getattr(state, "name", state)).rsplit(".", 1)[-1]
                if name and name != "SUCCESS":
                    return name
    return None


def skip_exit_barrier() -> None:
    """This process failed (a caught exception turned into an exit, as the run's worker does):
    the exit ends the group without waiting for the peers in a barrier."""
    _FAILED.append(True)


def _at_exit() -> None:
    # an uncaught exception was printed, or the process said it failed
    failed = getattr(sys, "last_value", None) is not None or bool(_FAILED)
    end_process_group(None if failed else EXIT_BARRIER_S)


def end_at_exit() -> None:
    """Once per process: end any process group still up when the interpreter exits (called as
    each group begins: a group is up again, so garbage may hold it)."""
    _COLLECTED.clear()
    if not _REGISTERED:
        _REGISTERED.append(True)
        atexit.register(_at_exit)
