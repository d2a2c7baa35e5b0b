"""torch's flight recorder, asked for before a stalled group is stopped: each worker's dump
crosses to the supervisor as a file, and `analyse` (pure) turns the dumps into
typed facts: the collective that never completed, its operation, the ranks that entered it and
the ranks that never did.

The recorder keeps a ring buffer of every collective a process group issued (operation, process
group, ``collective_seq_id``, state, sizes, the Python stack that issued it); sources:

- pytorch/pytorch#110960 (torch 2.2): ``torch._C._distributed_c10d._dump_nccl_trace()``
  returns the buffer as a pickle; each entry's state is "scheduled", "started" or "completed"
  (queried from its CUDA events when the dump is taken, which works while the streams are
  stuck). Enabled by ``TORCH_NCCL_TRACE_BUFFER_SIZE`` > 0 (docs:
  https://pytorch.org/docs/2.4/torch_nccl_environment_variables.html).
- pytorch/pytorch#117883 and #120262: the pickle was first a list of entries, then a dict with
  ``version``, ``pg_config`` (each group's ranks) and ``entries``; ``pg_status`` (each group's
  ``last_completed_collective``) follows (torch/csrc/distributed/c10d/FlightRecorder.hpp).
- pytorch/pytorch#129505 (torch 2.5): the keyword arguments ``includeCollectives``,
  ``includeStackTraces``, ``onlyActive``; the defaults return everything.
- pytorch/pytorch#152563 (torch 2.8): the recorder made vendor neutral
  (``TORCH_FR_BUFFER_SIZE``, read before the NCCL name); ``_dump_fr_trace()`` dumps the generic
  recorder (gloo's entries, on by default with 2,000 entries in torch 2.13), while NCCL keeps its
  own recorder behind ``_dump_nccl_trace()`` (both are asked here; a CPU build has only
  ``_dump_fr_trace``).
- https://docs.pytorch.org/tutorials/prototype/flight_recorder_tutorial.html: retrieving the
  buffer on demand through that API.

How it is asked for: the main thread of a stalled rank is blocked inside a collective, so no
Python signal handler would run there. `serve` starts a daemon thread in the worker that
waits (blocked in ``read``, no polling) on a FIFO in the attempt's run directory; the supervisor
(`request`) writes one byte to each rank's FIFO, and the thread calls every dump API the
build has, writes the bytes next to it and a status file last. The supervisor waits for the
status files of every rank together, up to a deadline; a rank whose process is stopped
(``SIGSTOP``: it cannot answer) is not asked nor waited for, and a rank without a listener,
without an answer, or whose torch has no dump API is a typed `DumpStatus`, never a hang. Every
private API is feature-checked and its failure is logged and said in the status.

The dumps are read (at most `MAX_DUMP_BYTES` each) and analysed by
`flightdump` (pure). Imports nothing but the standard library and that module (torch only in
the worker, only when it is already imported there).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from ..errors import FileFormatError, NoSpaceError, UnsafePathError
from ..machine import files
from .flightdump import Dump, DumpStatus, RankDump, merge_dumps, parse_dump
from .rundir import RunDir

log = logging.getLogger("resilient_strategy")

#: The buffer's size variable for NCCL (torch 2.2+), set for the workers of an NCCL decision
#: on a torch older than `FR_SINCE`, unless the user set it or `FR_BUFFER_VAR`.
BUFFER_VAR = "TORCH_NCCL_TRACE_BUFFER_SIZE"
#: The vendor-neutral name (read first by torch, which warns on every rank that the NCCL name is
#: deprecated): set on torch `FR_SINCE` and later; a user's value of either is kept.
FR_BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
#: The first torch (major, minor) that reads `FR_BUFFER_VAR` (the flight recorder made
#: vendor neutral: https://github.com/pytorch/pytorch/pull/152563, released in torch 2.8).
FR_SINCE = (2, 8)
#: Entries kept per process (torch 2.13's default for its generic recorder).
DEFAULT_ENTRIES = 2000
#: The dump APIs asked, in order (each its own recorder; absent ones are skipped).
DUMP_APIS = ("_dump_nccl_trace", "_dump_fr_trace")
#: How long the supervisor waits for every rank's answer.
WAIT_S = 5.0
#: The largest dump read (2,000 entries with their stacks are a few MB).
MAX_DUMP_BYTES = 64 << 20


def buffer_var(torch_version: str | None) -> str:
    """The size variable the installed torch expects (its version read from the package's
    metadata, never by importing it): `FR_BUFFER_VAR` from torch `FR_SINCE`, else
    (older, or a version that does not parse) `BUFFER_VAR`, which every torch since 2.2
    reads. Pure."""
    import re

    m = re.match(r"(\d+)\.(\d+)", torch_version or "")
    if m and (int(m.group(1)), int(m.group(2))) >= FR_SINCE:
        return FR_BUFFER_VAR
    return BUFFER_VAR


def buffer_env(backend: str, env: Mapping[str, str],
               torch_version: str | None = None) -> dict[str, str]:
    """The variable that turns NCCL's recorder on for the workers of a decision on ``backend``:
    only for NCCL, never over the user's (either name), under the name ``torch_version``
    expects (`buffer_var`)."""
    if backend != "nccl" or BUFFER_VAR in env or FR_BUFFER_VAR in env:
        return {}
    return {buffer_var(torch_version): str(DEFAULT_ENTRIES)}


# the worker's side: a thread that answers


def serve(run_dir: str | Path, local_rank: int, rank: int, c10d: Any = None) -> bool:
    """Start the daemon thread that answers the supervisor's request (`request`) with
    `respond` (``c10d`` as there). False where no FIFO can be made (then the supervisor
    reads "no listener")."""
    path = RunDir.of(run_dir).flight_fifo(local_rank)
    mkfifo = getattr(os, "mkfifo", None)
    if mkfifo is None:
        return False
    try:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # a relaunch's run directory is new; this is for a rerun by hand
        mkfifo(path, 0o600)
        # read and write: the open never blocks, and the FIFO has a reader for as long as this
        # process lives (the supervisor's knock fails at once only when the worker is gone)
        fd = os.open(path, os.O_RDWR)
    except OSError as exc:
        log.debug("flight recorder: no FIFO at %s: %s", path, exc)
        return False
    threading.Thread(target=_listen, args=(fd, Path(run_dir), local_rank, rank, c10d),
                     name="rs-flight-recorder", daemon=True).start()
    return True


def _listen(fd: int, run_dir: Path, local_rank: int, rank: int, c10d: Any) -> None:
    while True:
        try:
            if not os.read(fd, 64):  # blocks (without the GIL) until the supervisor knocks
                return
        except OSError:
            return
        respond(run_dir, local_rank, rank, c10d)


def respond(run_dir: str | Path, local_rank: int, rank: int, c10d: Any = None) -> dict[str, Any]:
    """Dump this process's flight recorder through every API the build has, each to
    `RunDir.flight_dump`, then write `RunDir.flight_status` (last: the supervisor waits for it).
    ``c10d``: the module holding the APIs (``torch._C._distributed_c10d``; a test passes its
    own). Never raises; returns the status written."""
    status: dict[str, Any] = {"rank": rank, "local_rank": local_rank, "apis": [],
                              "reasons": []}
    if c10d is None:
        if "torch" not in sys.modules:  # a TensorFlow worker, or torch not imported yet
            status["reasons"].append("torch is not imported in this worker")
        else:
            try:
                from torch._C import _distributed_c10d as c10d
            except Exception as exc:  # a build without distributed
                status["reasons"].append(f"no torch._C._distributed_c10d ({exc})")
    if c10d is not None:
        for api in DUMP_APIS:
            fn = getattr(c10d, api, None)
            if not callable(fn):
                continue
            try:
                data = fn()  # everything: collectives, their stacks, completed ones too
                if not isinstance(data, (bytes, bytearray)):
                    raise TypeError(f"returned {type(data).__name__}, not bytes")
                files.write_bytes_atomic(RunDir.of(run_dir).flight_dump(local_rank, api), bytes(data),
                                         durable=False, what="the flight recorder's dump")
                status["apis"].append(api)
            except Exception as exc:
                log.warning("flight recorder: %s failed: %s", api, exc)
                status["reasons"].append(f"{api} failed: {type(exc).__name__}: {exc}"[:300])
        if not status["apis"] and not status["reasons"]:
            status["reasons"].append(f"this torch has none of {', '.join(DUMP_APIS)}")
    with contextlib.suppress(OSError, NoSpaceError, TypeError, ValueError):
        files.write_json_atomic(RunDir.of(run_dir).flight_status(local_rank), status, durable=False,
                                what="the flight recorder's status")
    return status


# the supervisor's side: ask, wait, read


def request(run_dir: str | Path, local_ranks: Iterable[tuple[int, int]],
            wait_s: float = WAIT_S, clock: Callable[[], float] = time.monotonic,
            sleep: Callable[[float], None] = time.sleep,
            stopped: Callable[[int], str] | None = None) -> list[RankDump]:
    """Ask each worker (``(local_rank, rank)`` pairs) for its dump and read the answers; every
    rank's outcome is typed, and the whole call takes at most about ``wait_s``. Every rank is
    asked at once and waited for together: the call ends when the last one that can answer
    has. ``stopped(local_rank)``: why that rank's process cannot answer now ("" when it can),
    read before asking and on every look while waiting: a stopped process (``SIGSTOP``, a
    debugger) is neither asked nor waited for (`DumpStatus.STOPPED`), so its silence costs
    nothing while the others' dumps are still taken."""
    run_dir = Path(run_dir)
    where = RunDir.of(run_dir)
    asked: dict[int, int] = {}
    out: dict[int, RankDump] = {}
    for lr, rank in local_ranks:
        with contextlib.suppress(FileNotFoundError):
            where.flight_status(lr).unlink()  # an earlier request's answer is not this one's
        why = stopped(lr) if stopped is not None else ""
        if why:
            out[lr] = RankDump(lr, rank, DumpStatus.STOPPED, why)
            continue
        reason = _knock(where.flight_fifo(lr))
        if reason:
            out[lr] = RankDump(lr, rank, DumpStatus.NO_LISTENER, reason)
        else:
            asked[lr] = rank
    deadline = clock() + wait_s
    pending = dict(asked)
    while pending and clock() < deadline:
        for lr in list(pending):
            if where.flight_status(lr).exists():
                del pending[lr]
            elif stopped is not None and (why := stopped(lr)):
                out[lr] = RankDump(lr, pending.pop(lr), DumpStatus.STOPPED, why)
        if pending:
            sleep(0.05)
    for lr, rank in asked.items():
        if lr not in out:
            out[lr] = read_answer(run_dir, lr, rank)
    return [out[lr] for lr in sorted(out)]


def _knock(path: Path) -> str:
    """Write one byte to a worker's FIFO without blocking; "" when it was heard, else why not."""
    try:
        if not stat.S_ISFIFO(os.lstat(path).st_mode):
            return "not a FIFO"
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return "the worker started no listener"
    except OSError as exc:  # ENXIO: nobody has it open for reading (the worker is gone)
        return f"no worker listening ({exc.strerror or exc})"
    try:
        os.write(fd, b"1")
    except OSError as exc:
        return f"could not ask ({exc.strerror or exc})"
    finally:
        os.close(fd)
    return ""


def read_answer(run_dir: str | Path, local_rank: int, rank: int) -> RankDump:
    """One rank's answer, parsed (`parse_dump`), after `respond` wrote it."""
    try:
        raw = files.read_bytes(RunDir.of(run_dir).flight_status(local_rank),
                               max_bytes=1 << 16)
    except (OSError, UnsafePathError, FileFormatError):
        return RankDump(local_rank, rank, DumpStatus.NO_ANSWER,
                        "no answer before the deadline (its process may hold the GIL)")
    try:
        status = json.loads(raw[:1 << 16])
        apis = [str(a) for a in status.get("apis", ())]
        reasons = "; ".join(str(r) for r in status.get("reasons", ()))
        rank = int(status.get("rank", rank))
    except (ValueError, TypeError, AttributeError) as exc:
        return RankDump(local_rank, rank, DumpStatus.UNREADABLE, f"its status: {exc}")
    if not apis:
        return RankDump(local_rank, rank, DumpStatus.NOT_AVAILABLE, reasons)
    dumps: list[Dump] = []
    kept: list[str] = []
    for api in apis:
        path = RunDir.of(run_dir).flight_dump(local_rank, api)
        try:
            data = files.read_bytes(path, max_bytes=MAX_DUMP_BYTES)  # FileFormatError: larger
            dumps.append(parse_dump(data))
            kept.append(str(path))
        except (OSError, ValueError, UnsafePathError) as exc:
            return RankDump(local_rank, rank, DumpStatus.UNREADABLE, f"{api}: {exc}")
    return RankDump(local_rank, rank, DumpStatus.DUMPED, reasons, merge_dumps(dumps),
                    tuple(kept))
