"""Asynchronous checkpoints: the training step pays for a copy of the state in host memory, a
background thread writes it (`checkpoint.Checkpointer` with ``asynchronous=True``, the default).

- `snapshot`: a copy of a training state (nested dicts, lists and tuples of tensors and plain
  values) that later steps cannot change: every tensor copied into host memory (into the buffers
  of the previous save where shapes match; pinned memory for GPU tensors, copied without blocking
  and waited for by the writer, never by the step), containers rebuilt, other values deep-copied.
- `Writer`: at most one write in flight per checkpointer. A new save first waits for the
  previous write (never skips it: a skipped save would stretch the interval the user asked for,
  and the work a fault loses with it, without bound when writes are slower than the interval;
  the wait is recorded as the save's ``waited_s`` and said once). A write's failure (a full or
  read-only disk: the typed `NoSpaceError`) is kept and raised in the training thread at its next
  optimizer step, save, ``wait()`` or shutdown, and said in one line at once; nothing is published
  then, so the newest complete checkpoint stays the newest.
- The process's writers in flight: a resume of the same directory waits for them (`wait_for`),
  and so does the exit (an ``atexit`` hook, and `teardown` before it ends the process group),
  each wait bounded by `WAIT_S`. A write still running at that deadline is said and abandoned:
  its temporary file is never the checkpoint, and the next restore sweeps it.

torch is imported only inside functions.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..process import PROCESS

log = logging.getLogger("resilient_strategy")

#: The longest a resume, the exit or a new save waits for a write in flight (seconds).
WAIT_S = 600.0
#: An asynchronous save goes synchronous when its host copy would take more than this share
#: of the memory the machine has available (the copy is held until the write ends).
HOST_SHARE = 0.5

ASYNC, SYNC = "async", "sync"
IN_FLIGHT, WRITTEN, FAILED = "in_flight", "written", "failed"
UNFINISHED, SKIPPED = "unfinished", "skipped"


@dataclass(frozen=True)
class SaveRecord:
    """One save, as the training loop paid for it and as its write ended (typed, for tests and
    for the goodput's checkpoint stalls)."""

    step: int
    """The optimizer-step count of the saved state."""
    mode: str
    """`ASYNC` (written in the background) or `SYNC` (written by the step itself)."""
    stall_s: float
    """Seconds the training thread spent in the save: the wait for the previous write, the host
    copy, and (`SYNC`) the write itself."""
    waited_s: float = 0.0
    """Of ``stall_s``, the wait for the previous write still in flight."""
    outcome: str = IN_FLIGHT
    """`IN_FLIGHT`, `WRITTEN`, `FAILED`, `UNFINISHED` (abandoned at the exit's deadline) or
    `SKIPPED` (the previous write was still running after `WAIT_S`)."""
    write_s: float | None = None
    """Seconds the write took (None while in flight)."""
    error: str = ""
    """What failed, in one line (`FAILED`)."""
    reason: str = ""
    """Why a save asked to be asynchronous was written synchronously (``host_memory``: its copy
    would not fit the memory available), else ""."""


# ----- the host copy -------------------------------------------------------------------------
def snapshot(state: Any, buffers: dict[tuple[Any, ...], Any] | None = None) -> tuple[Any, Any]:
    """A copy of ``state`` in host memory that later steps cannot change, and what the writer
    waits on before reading it (a CUDA event after non-blocking copies; None when every copy
    is done). ``buffers`` (kept by the caller across saves) holds the host tensors to copy into
    when their shape and dtype match."""
    import torch

    cuda: list[bool] = []

    def copy_of(value: Any, path: tuple[Any, ...]) -> Any:
        if value is None or isinstance(value, _PLAIN):  # immutable: the value itself
            return value
        if isinstance(value, tuple) and all(v is None or isinstance(v, _PLAIN) for v in value):
            return value  # Python's RNG state: 625 ints
        if isinstance(value, torch.Tensor):
            return _tensor(torch, value, path, buffers, cuda)
        if isinstance(value, dict):  # an OrderedDict stays one (a model's state_dict)
            items = [(k, copy_of(v, (*path, k))) for k, v in value.items()]
            return dict(items) if type(value) is dict else type(value)(items)
        if isinstance(value, list):
            return [copy_of(v, (*path, i)) for i, v in enumerate(value)]
        if isinstance(value, tuple) and not hasattr(value, "_fields"):
            return tuple(copy_of(v, (*path, i)) for i, v in enumerate(value))
        return copy.deepcopy(value)

    out = copy_of(state, ())
    ready = None
    if cuda:
        ready = torch.cuda.Event()  # type: ignore[no-untyped-call]
        ready.record()
    return out, ready


_PLAIN = (bool, int, float, complex, str, bytes)


def _tensor(torch: Any, t: Any, path: tuple[Any, ...], buffers: dict[tuple[Any, ...], Any] | None,
            cuda: list[bool]) -> Any:
    t = t.detach()
    if t.layout != torch.strided or t.is_quantized or type(t) is not torch.Tensor:
        return t.to("cpu", copy=True)
    on_gpu = t.device.type == "cuda"
    buf = None if buffers is None else buffers.get(path)
    if buf is None or buf.shape != t.shape or buf.dtype != t.dtype \
            or (on_gpu and not buf.is_pinned()):
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=on_gpu)
        if buffers is not None:
            buffers[path] = buf
    buf.copy_(t, non_blocking=on_gpu)
    if on_gpu:
        cuda.append(True)
    return buf


def tensor_bytes(state: Any) -> int:
    """Bytes of the tensors in ``state`` (a DTensor's local shard only)."""
    import torch

    total = 0
    stack = [state]
    while stack:
        value = stack.pop()
        if isinstance(value, torch.Tensor):
            local = getattr(value, "_local_tensor", value)
            total += int(local.numel()) * int(local.element_size())
        elif isinstance(value, dict):
            stack.extend(value.values())
        elif isinstance(value, (list, tuple)):
            stack.extend(value)
    return total


def fits_host(copy_bytes: int, available: int | None) -> bool:
    """Whether a host copy of ``copy_bytes`` fits the memory ``available`` (None: unknown, so
    assumed to fit) within `HOST_SHARE`."""
    return available is None or copy_bytes <= HOST_SHARE * available


# ----- the writer ----------------------------------------------------------------------------
class Writer:
    """One checkpointer's background writes, at most one in flight (see the module docstring).
    ``records`` holds every save, in order; the writer thread updates the last one's
    outcome."""

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.records: list[SaveRecord] = []
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._lock = threading.Lock()
        self.collective = False  # the write in flight takes part in a collective (DCP)

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def failed(self) -> bool:
        """A write failed and its error was not raised yet."""
        return self._error is not None

    def record(self, rec: SaveRecord) -> int:
        with self._lock:
            self.records.append(rec)
            return len(self.records) - 1

    def update(self, index: int, **changes: Any) -> None:
        with self._lock:
            self.records[index] = replace(self.records[index], **changes)

    def start(self, index: int, work: Callable[[], None], *, collective: bool = False) -> None:
        """Run ``work`` (the write and its publication) in a thread of its own; the caller has
        waited for the previous one."""
        if self.in_flight:
            raise RuntimeError("a checkpoint write is already in flight")
        self.collective = collective

        def run() -> None:
            t0 = time.monotonic()
            try:
                work()
            except BaseException as exc:  # kept for the training thread; said now
                self._error = exc
                self.update(index, outcome=FAILED, write_s=time.monotonic() - t0,
                            error=one_line(exc))
                log.warning("resilient_strategy: the checkpoint of step %d was not written "
                            "(%s); the newest complete checkpoint stays the one to resume from",
                            self.records[index].step, one_line(exc))
                return
            self.update(index, outcome=WRITTEN, write_s=time.monotonic() - t0)

        thread = threading.Thread(target=run, name="resilient-strategy-checkpoint", daemon=True)
        self._thread = thread
        _register(self)
        thread.start()

    def wait(self, timeout: float = WAIT_S) -> bool:
        """Wait up to ``timeout`` seconds for the write in flight; True when none is left."""
        thread = self._thread
        if thread is not None:
            thread.join(max(0.0, timeout))
        return not self.in_flight

    def raise_error(self) -> None:
        """Raise the failed write's error (once) in the caller's thread."""
        exc, self._error = self._error, None
        if exc is not None:
            raise exc

    def abandon(self, waited_s: float) -> None:
        """The exit's deadline passed with the write still running: said, and recorded."""
        with self._lock:
            for i, rec in enumerate(self.records):
                if rec.outcome == IN_FLIGHT:
                    self.records[i] = replace(rec, outcome=UNFINISHED)
                    log.warning("resilient_strategy: the checkpoint of step %d was still being "
                                "written after %.0f s at exit and was abandoned; the newest "
                                "complete checkpoint stays the one to resume from", rec.step,
                                waited_s)


def one_line(exc: BaseException) -> str:
    """An exception on one line: its class and the first 200 characters of its words."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__


# ----- the process's writers -----------------------------------------------------------------
_WRITERS: weakref.WeakSet[Writer] = PROCESS.hold(
    "frameworks.checkpoint_writer.writers", weakref.WeakSet,
    "the checkpoint writers of this process, waited for at a resume and at the exit")
_HOOKED: list[bool] = PROCESS.hold(
    "frameworks.checkpoint_writer.hooked", list, "whether the exit hook is registered")


def _register(writer: Writer) -> None:
    _WRITERS.add(writer)
    if not _HOOKED:
        _HOOKED.append(True)
        atexit.register(wait_all)


def wait_for(directory: Path, timeout: float = WAIT_S) -> bool:
    """Before a resume reads ``directory``: wait for this process's writes into it (at most
    ``timeout`` seconds together); True when none is left in flight."""
    where = os.path.realpath(directory)
    deadline = time.monotonic() + timeout
    done = True
    for writer in list(_WRITERS):
        if os.path.realpath(writer.directory) == where:
            done = writer.wait(deadline - time.monotonic()) and done
    return done


def wait_all(timeout: float = WAIT_S, *, collective: bool = True) -> bool:
    """At the exit or the end of a process group: wait for every write in flight (at most
    ``timeout`` seconds together; ``collective=False``: not for a write that takes part in a
    collective, whose peers may be gone); a write still running then is said and abandoned (a
    failure was said when it happened). True when none is left in flight. Never raises."""
    deadline = time.monotonic() + timeout
    done = True
    for writer in list(_WRITERS):
        with contextlib.suppress(Exception):
            if writer.in_flight and (collective or not writer.collective) \
                    and not writer.wait(deadline - time.monotonic()):
                writer.abandon(timeout)
            done = done and not writer.in_flight
    return done
