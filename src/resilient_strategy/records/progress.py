"""Progress records: where each worker is, and the judgement that one of them has stalled.

One protocol for probe workers and training ranks alike. Imports nothing but the standard
library (no framework), so a worker may use it before it imports torch or TensorFlow.

Writer (in the worker; one ``pwrite`` of a fixed-size record per call, a few microseconds, so
cheap enough for every training step)::

    w = ProgressWriter(path)            # or ProgressWriter.from_env(os.environ) (PROGRESS_VAR)
    w.phase(IMPORTED)                   # STARTED is written by the constructor
    w.phase(DEVICE_READY); w.phase(COMM_SETUP); w.phase(COMM_READY)
    with w.collective(k, nbytes):       # or w.enter(k, nbytes) ... w.leave(k): collective k
        all_reduce(buf); synchronize()  #   (k counts up from 1, the same sequence on every rank)
    w.step(n)                           # a training step done (optional)
    w.phase(FINISHED)

Each rank owns one small file; the latest record overwrites the previous one (no growth, no
locking). The file's blocks are allocated when the writer opens it (``posix_fallocate``, else
zeros written), so a full disk is a `NoSpaceError` naming the
file before any training, never a SIGBUS through the mapping mid-run. Only a regular file is
written or read: a FIFO or device planted in its place is refused without blocking (opened
``O_NONBLOCK``, checked with ``fstat``), and the writer never follows a symlink. ``allow_s`` on `ProgressWriter.enter` declares extra time a region may need on
top of the transfer (a first call that compiles a graph, DDP's first step).

Watcher (in the runner, polled every few tens of milliseconds)::

    watcher = StallWatcher(paths, StallPolicy())  # one path per rank, in rank order
    stall = watcher.poll()              # a Stall once one is judged, else None

Training ranks (mid-run supervision) use the same records: wrap each optimizer step, whose
all-reduces run inside it, as collective k (``with w.collective(step, gradient_bytes,
allow_s=3 * measured_step_s)``), and watch with ``StallPolicy(quiet_s=None)`` or a ``quiet_s``
that covers evaluation and checkpoints; a rank that never reaches step k while the others wait
in it is then a straggler after ``arrive_grace_s``, and a step every rank entered but none left
is a hang after its grace.

What is judged (all times on the watcher's own clock, from when it saw a record change):

* starting and importing: never (a generous allowance: the caller's outer deadline bounds it);
* communicator setup: once *every* rank has entered it, all must be ready within
  ``setup_grace_s``; a rank past its device setup that has not entered it while others wait,
  within ``arrive_grace_s`` (kind ``straggler``);
* collective k: once every rank has entered it, every rank must leave it within
  `StallPolicy.collective_grace` (latency allowance + ``safety`` x the transfer time at the
  slowest bandwidth measured, in this group or ``floor_bytes_per_s``); a rank that has not
  entered it ``arrive_grace_s`` after the first did and after its own last record is a straggler;
* ``quiet_s`` (optional): a rank past communicator setup and outside any collective may stay
  silent at most this long (probes: their code never pauses; training: leave it None, or set it
  from the measured step time).

`Stall` says which kind, where (``phase``, ``k``) and which ranks; the caller decides
what to do (a probe runner kills the group and reports a hang).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import mmap
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import NoSpaceError

#: The environment variable a training launcher may use to hand a rank its progress file.
PROGRESS_VAR = "RESILIENT_STRATEGY_PROGRESS"

STARTED = "started"
IMPORTED = "imported"  # the framework is imported
DEVICE_READY = "device_ready"  # the device is chosen and initialized
COMM_SETUP = "comm_setup"  # inside communicator setup (init_process_group, strategy creation)
COMM_READY = "comm_ready"
COLLECTIVE = "collective"  # inside collective k
COLLECTIVE_DONE = "collective_done"  # collective k completed (synchronized)
STEP_DONE = "step_done"  # training step k done
FINISHED = "finished"
PHASES = (STARTED, IMPORTED, DEVICE_READY, COMM_SETUP, COMM_READY, COLLECTIVE, COLLECTIVE_DONE,
          STEP_DONE, FINISHED)
_ORDER = {p: i for i, p in enumerate(PHASES)}

_RECORD_BYTES = 128
#: The slowest all-reduce bus bandwidth we have measured for any transport, divided by about
#: 10: gloo on CPU tensors 2.2-2.4 GB/s and NCCL over sockets 3.8 GB/s on the 2x H200 host
#: (field notes); gloo between 2 processes on the loaded 2-core CI machine 0.4 GB/s.
#: A transfer that takes ``safety`` times longer than at this floor is not slow but stuck.
FLOOR_BYTES_PER_S = 0.05e9


_FORMAT = b"%d %s %d %d %.6f %.3f %.6f %d %d"
_PHASE_BYTES = {p: p.encode("ascii") for p in PHASES}
#: ``Record.dev`` of a rank whose device progress is not followed (CPU, gloo, TensorFlow).
NOT_FOLLOWED = -1


def _encode(seq: int, phase: bytes, k: int, nbytes: int, t: float, allow_s: float,
            took_s: float, dev: int = NOT_FOLLOWED) -> bytes:
    """One record's bytes: the fields, the sequence number again (a torn record is seen),
    padded to a fixed size. The writer calls it on every step: no objects, one format."""
    data = _FORMAT % (seq, phase, k, nbytes, t, allow_s, took_s, dev, seq)
    return data[:_RECORD_BYTES - 1].ljust(_RECORD_BYTES - 1) + b"\n"


@dataclass(frozen=True)
class Record:
    """One progress record as written: a sequence number, the phase, a counter ``k`` (the
    collective or step), the bytes it moves, the writer's monotonic time, the region's extra
    allowance, on ``collective_done``, how long the collective took, and ``dev``: the highest
    collective seen completed *on the device* (`DevicePoller`; under NCCL a collective
    returns to Python when it is enqueued), `NOT_FOLLOWED` where the device is not
    followed (there, leaving a collective is completing it)."""

    seq: int
    phase: str
    k: int = 0
    nbytes: int = 0
    t: float = 0.0
    allow_s: float = 0.0
    took_s: float = 0.0
    dev: int = NOT_FOLLOWED

    def encode(self) -> bytes:
        return _encode(self.seq, self.phase.encode("ascii"), self.k, self.nbytes, self.t,
                       self.allow_s, self.took_s, self.dev)

    @classmethod
    def decode(cls, data: bytes) -> Record | None:
        """The record in ``data``, or None when it is empty, torn or not a record (the 8-field
        records of earlier versions, without ``dev``, are read too)."""
        try:
            fields = data.decode("ascii").split()
            if len(fields) not in (8, 9) or fields[0] != fields[-1] or fields[1] not in _ORDER:
                return None
            dev = int(fields[7]) if len(fields) == 9 else NOT_FOLLOWED
            return cls(int(fields[0]), fields[1], int(fields[2]), int(fields[3]),
                       float(fields[4]), float(fields[5]), float(fields[6]), dev)
        except (UnicodeDecodeError, ValueError):
            return None


class ProgressWriter:
    """Writes one rank's progress to ``path``; with ``path`` None or "", every call is a no-op.

    Writing never raises: a worker must not fail because its progress could not be recorded
    (the watcher then simply sees no progress, and the outer deadline still holds).
    """

    def __init__(self, path: str | None, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seq = 0
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self._entered: dict[int, float] = {}
        #: the record's fields but the sequence number, kept so that the device's progress
        #: (written from `DevicePoller`'s thread) rewrites the latest record; the lock
        #: keeps the two writers' records whole
        self._last: tuple[bytes, int, int, float, float, float] = (_PHASE_BYTES[STARTED], 0, 0,
                                                                    0.0, 0.0, 0.0)
        self._dev = NOT_FOLLOWED
        self._lock = threading.Lock()
        #: when each phase was first reached (the clock's seconds): a probe reports them so that
        #: the trace says where its time went (start-up, backend set-up, checks, ...)
        self.marks: dict[str, float] = {}
        if path:
            self._fd = _open_regular(path)
            if self._fd is not None and _allocate(self._fd, path):
                # A record is a store into a shared mapping of the file (readers see it through
                # the page cache): no system call per step. pwrite where mapping fails. Only
                # over allocated blocks: a store into a hole on a full disk is a SIGBUS.
                with contextlib.suppress(OSError, ValueError):
                    self._map = mmap.mmap(self._fd, _RECORD_BYTES, mmap.MAP_SHARED,
                                          mmap.PROT_READ | mmap.PROT_WRITE)
        self.phase(STARTED)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> ProgressWriter:
        return cls(env.get(PROGRESS_VAR) or None)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def phase(self, name: str, k: int = 0, nbytes: int = 0, *, allow_s: float = 0.0,
              took_s: float = 0.0) -> None:
        if name not in _ORDER:
            raise ValueError(f"unknown progress phase {name!r}; one of {PHASES}")
        now = self._clock()
        self.marks.setdefault(name, now)
        if self._fd is None:
            return
        with self._lock:
            self._last = (_PHASE_BYTES[name], k, nbytes, now, allow_s, took_s)
            self._write()

    def _write(self) -> None:
        """The latest record again with the next sequence number (the lock held)."""
        self._seq += 1
        data = _encode(self._seq, *self._last, self._dev)
        if self._map is not None:
            self._map[:] = data
            return
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.pwrite(self._fd, data, 0)

    def follow_device(self, done_k: int) -> None:
        """From now on the records say how far the device got (``dev``), starting at
        collective ``done_k`` (those before were completed: a resumed run's steps)."""
        with self._lock:
            self._dev = max(self._dev, done_k, 0)
            if self._fd is not None:
                self._write()

    def device_done(self, k: int) -> None:
        """Collective ``k`` (and every one before it) completed on the device. A no-op unless
        `follow_device` was called (then from any thread)."""
        with self._lock:
            if self._dev == NOT_FOLLOWED or k <= self._dev:
                return
            self._dev = k
            if self._fd is not None:
                self._write()

    def enter(self, k: int, nbytes: int = 0, *, allow_s: float = 0.0) -> None:
        """About to run collective ``k`` (moving ``nbytes``); ``allow_s``: extra time it may need."""
        self._entered[k] = self._clock()
        self.phase(COLLECTIVE, k, nbytes, allow_s=allow_s)

    def leave(self, k: int, nbytes: int = 0) -> None:
        """Collective ``k`` completed (call after synchronizing with the device)."""
        start = self._entered.pop(k, None)
        took = max(0.0, self._clock() - start) if start is not None else 0.0
        self.phase(COLLECTIVE_DONE, k, nbytes, took_s=took)

    @contextlib.contextmanager
    def collective(self, k: int, nbytes: int = 0, *, allow_s: float = 0.0) -> Iterator[None]:
        self.enter(k, nbytes, allow_s=allow_s)
        yield
        self.leave(k, nbytes)

    def step(self, n: int) -> None:
        self.phase(STEP_DONE, n)

    def close(self) -> None:
        if self._map is not None:
            with contextlib.suppress(OSError, ValueError, BufferError):
                self._map.close()
            self._map = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


class DevicePoller:
    """Follows collectives to their completion on the device, for a writer whose collectives
    return when enqueued (NCCL): `record` (the main thread, after leaving collective
    ``k``) records a device event through ``make_event``; a daemon thread polls the oldest
    event's ``query()`` every ``interval_s`` and writes `device_done`.
    The record then tells "enqueued and not completed on the device" (``k`` left, ``dev`` below
    it) from "completed" and from "never enqueued". Framework-free: ``make_event`` is the
    runtime's (``torch.cuda.Event`` recorded on the current stream). A failing ``query()``
    (the device lost) ends the polling: the records then show no further device progress.
    At most ``limit`` events wait (the oldest are dropped: their collective is then known
    completed once a later one is)."""

    def __init__(self, writer: ProgressWriter, make_event: Callable[[], Any], *,
                 start_k: int = 0, interval_s: float = 0.05, limit: int = 1024) -> None:
        self.writer = writer
        self.make_event = make_event
        self.interval_s = interval_s
        self.pending: collections.deque[tuple[int, Any]] = collections.deque(maxlen=limit)
        self.failed: BaseException | None = None
        self._wake = threading.Event()
        writer.follow_device(start_k)
        self._thread = threading.Thread(target=self._run, name="rs-device-progress",
                                        daemon=True)
        self._thread.start()

    def record(self, k: int) -> None:
        """Collective ``k`` was enqueued and left: follow it to the device."""
        if self.failed is not None:
            return
        try:
            self.pending.append((k, self.make_event()))
        except Exception as exc:  # a device already lost: no further device progress
            self.failed = exc
            return
        self._wake.set()

    def poll_once(self) -> bool:
        """Write what completed; whether events are still pending. (The thread's body; a test
        calls it directly.)"""
        while self.pending:
            k, event = self.pending[0]
            try:
                done = bool(event.query())
            except Exception as exc:
                self.failed = exc
                self.pending.clear()
                return False
            if not done:
                return True
            self.pending.popleft()
            self.writer.device_done(k)
        return False

    def _run(self) -> None:
        while self.failed is None:
            if not self.poll_once():
                self._wake.wait()
                self._wake.clear()
                continue
            time.sleep(self.interval_s)


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
#: posix_fallocate's answers where the filesystem cannot preallocate (write zeros instead).
_NO_FALLOCATE = (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS)
_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def _open_regular(path: str) -> int | None:
    """``path`` opened for writing (created 0600), never through a symlink, never blocking;
    None when it cannot be opened or is not a regular file (a FIFO, a device)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | _NONBLOCK | _NOFOLLOW, 0o600)
    except (OSError, ValueError):  # ValueError: a NUL character in the path
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _allocate(fd: int, path: str) -> bool:
    """Give the record's bytes real blocks now. True when they have them; raises NoSpaceError
    when the disk (or quota) is full; False for any other failure (then no mapping)."""
    try:
        os.ftruncate(fd, _RECORD_BYTES)
        try:
            os.posix_fallocate(fd, 0, _RECORD_BYTES)
        except AttributeError:  # no posix_fallocate on this platform
            os.pwrite(fd, b"\0" * _RECORD_BYTES, 0)
        except OSError as exc:
            if exc.errno not in _NO_FALLOCATE:
                raise
            os.pwrite(fd, b"\0" * _RECORD_BYTES, 0)
            os.fsync(fd)
    except OSError as exc:
        if exc.errno in _FULL:
            os.close(fd)
            raise NoSpaceError(path, "the progress file") from exc
        return False
    return True


def read_record(path: str) -> Record | None:
    """The latest record in ``path``; None when there is none yet (or it is being rewritten),
    or when ``path`` is not a regular file (a FIFO is not opened for blocking)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | _NONBLOCK)
    except (OSError, ValueError):
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return Record.decode(os.pread(fd, _RECORD_BYTES, 0))
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class StallPolicy:
    """How long each kind of wait may last before it is a stall. See the module docstring."""

    setup_grace_s: float = 10.0
    arrive_grace_s: float = 3.0
    collective_base_s: float = 2.0  # latency and scheduling on a loaded host, for any collective
    first_collective_extra_s: float = 3.0  # NCCL connects its peers lazily, at the first one
    floor_bytes_per_s: float = FLOOR_BYTES_PER_S
    safety: float = 4.0
    quiet_s: float | None = None

    def collective_grace(self, k: int, nbytes: int, allow_s: float = 0.0,
                         measured_s_per_byte: float = 0.0) -> float:
        """Seconds collective ``k`` of ``nbytes`` may take once every rank has entered it."""
        per_byte = max(1.0 / self.floor_bytes_per_s, measured_s_per_byte)
        extra = self.first_collective_extra_s if k <= 1 else 0.0
        return self.collective_base_s + extra + allow_s + self.safety * nbytes * per_byte


@dataclass(frozen=True)
class Stall:
    """A judged stall: ``kind`` is ``setup`` (every rank in communicator setup, none done),
    ``collective`` (every rank entered collective ``k``, not all left), ``straggler`` (ranks
    the others wait for never arrived) or ``quiet`` (a ready rank silent too long); the
    supervisor's watch adds ``stopped`` (the named ranks' processes are stopped), ``busy``
    (the named ranks kept the others waiting past the busy ceiling, burning CPU in their own
    code) and ``asleep`` (the named ranks neither progressed nor used CPU time). ``alone``: the
    ranks were judged by their own progress, nobody waiting on them (one process, the
    teardown after the last step); ``waited_s`` is then how long they were stopped or
    asleep."""

    kind: str
    phase: str  # COMM_SETUP or COLLECTIVE (or the quiet rank's phase)
    k: int
    ranks: tuple[int, ...]  # the ranks blamed: stuck inside, or never arrived
    waited_s: float
    limit_s: float
    positions: tuple[str, ...]  # every rank's last phase, for the report
    alone: bool = False

    def where(self) -> str:
        if self.alone and self.phase in (STEP_DONE, COLLECTIVE_DONE):
            return f"after step {self.k}"
        if self.alone and self.phase == FINISHED:
            return "after its last step"
        return "communicator setup" if self.phase == COMM_SETUP else (
            f"collective {self.k}" if self.phase in (COLLECTIVE, COLLECTIVE_DONE) else self.phase)

    def describe(self) -> str:
        ranks = ", ".join(map(str, self.ranks))
        s = "s" if len(self.ranks) > 1 else ""
        if self.alone:
            how = ("stopped (its process will not run until continued)" if self.kind == "stopped"
                   else "asleep (no progress, and no CPU time used by its process or those it "
                   "started)")
            at = self.where() if self.phase in (STEP_DONE, COLLECTIVE_DONE, FINISHED) else (
                f"in {self.where()}")
            what = (f"rank{s} {ranks} {how} for {self.waited_s:.1f} s {at}, with nobody "
                    f"waiting on it (allowed {self.limit_s:.1f} s)")
        elif self.kind == "straggler":
            what = (f"rank{s} {ranks} never reached {self.where()} while the others waited "
                    f"{self.waited_s:.1f} s (allowed {self.limit_s:.1f} s)")
        elif self.kind == "stopped":
            what = (f"rank{s} {ranks} stopped (its process will not run until continued) while "
                    f"the others waited in {self.where()} {self.waited_s:.1f} s (allowed "
                    f"{self.limit_s:.1f} s)")
        elif self.kind == "busy":
            what = (f"rank{s} {ranks} busy in the script's own code for {self.waited_s:.1f} s "
                    f"while the others waited in {self.where()} (allowed {self.limit_s:.1f} s: "
                    "--busy-timeout)")
        elif self.kind == "quiet":
            what = (f"rank{s} {ranks} fell silent after {self.where()} for {self.waited_s:.1f} s "
                    f"(allowed {self.limit_s:.1f} s)")
        else:
            what = (f"rank{s} {ranks} stuck in {self.where()} for {self.waited_s:.1f} s after "
                    f"every rank entered it (allowed {self.limit_s:.1f} s)")
        return f"{what}; ranks at: {', '.join(self.positions)}"


class StallWatcher:
    """Judges the progress of a group of ranks (one record file each). Not thread-safe."""

    def __init__(self, paths: Sequence[str], policy: StallPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.paths = tuple(paths)
        self.policy = policy or StallPolicy()
        self._clock = clock
        n = len(self.paths)
        self.records: list[Record | None] = [None] * n
        self._changed_at = [0.0] * n  # watcher time of each rank's last new record
        self._setup_at: list[float | None] = [None] * n  # first seen in (or past) setup
        self._entered_at: list[dict[int, float]] = [{} for _ in range(n)]
        self._entered_k = [0] * n  # highest collective entered
        self._done_k = [0] * n  # highest collective left
        self._dev = [NOT_FOLLOWED] * n  # highest collective completed on the device, if followed
        self._allow: dict[int, float] = {}
        self._nbytes: dict[int, int] = {}
        self.s_per_byte = 0.0  # slowest measured transfer of >= 1 MiB, seconds per byte

    def read(self, now: float | None = None) -> None:
        """Take in every rank's latest record."""
        now = self._clock() if now is None else now
        for r, path in enumerate(self.paths):
            rec, old = read_record(path), self.records[r]
            if rec is None or (old is not None and rec.seq <= old.seq):
                continue
            self.records[r] = rec
            self._changed_at[r] = now
            self._dev[r] = rec.dev
            order = _ORDER[rec.phase]
            if order >= _ORDER[COMM_SETUP] and self._setup_at[r] is None:
                self._setup_at[r] = now
            if rec.phase in (COLLECTIVE, COLLECTIVE_DONE) and rec.k > 0:
                if rec.k > self._entered_k[r]:
                    self._entered_k[r] = rec.k
                    self._entered_at[r][rec.k] = now
                if rec.phase == COLLECTIVE:
                    self._allow[rec.k] = max(self._allow.get(rec.k, 0.0), rec.allow_s)
                    self._nbytes[rec.k] = max(self._nbytes.get(rec.k, 0), rec.nbytes)
                else:
                    self._done_k[r] = max(self._done_k[r], rec.k)
                    if rec.nbytes >= 1 << 20 and rec.took_s > 0:
                        self.s_per_byte = max(self.s_per_byte, rec.took_s / rec.nbytes)
            # Records overwrite each other between polls: a rank seen outside any collective
            # (a step done, finished, ...) has left every collective it entered, and one seen
            # inside collective k has left the ones before it, whether or not the watcher saw
            # their "left" records.
            if rec.phase == COLLECTIVE:
                self._done_k[r] = max(self._done_k[r], rec.k - 1)
            elif rec.phase != COLLECTIVE_DONE:
                self._done_k[r] = max(self._done_k[r], self._entered_k[r])

    def done_on_device(self) -> list[int]:
        """Each rank's highest collective completed: left, and (where the device is followed)
        completed on the device too. A rank that left a collective its device never finished
        still waits in it."""
        return [d if dev == NOT_FOLLOWED else min(d, dev)
                for d, dev in zip(self._done_k, self._dev, strict=True)]

    def device_behind(self, r: int) -> bool:
        """Whether rank ``r`` left a collective (enqueued it) that its device has not
        completed: it waits on its device, whatever its CPU does."""
        return self._dev[r] != NOT_FOLLOWED and self._dev[r] < self._done_k[r]

    def poll(self, now: float | None = None) -> Stall | None:
        """Read the records, then judge: a `Stall`, or None while all is well."""
        now = self._clock() if now is None else now
        self.read(now)
        return self.judge(now)

    def changed_at(self, r: int) -> float:
        """The watcher's time of rank ``r``'s last new record (0.0: none seen)."""
        return self._changed_at[r]

    def positions(self) -> tuple[str, ...]:
        """Every rank's last phase in words, for a report."""
        return self._positions()

    def _positions(self) -> tuple[str, ...]:
        out = []
        for r, rec in enumerate(self.records):
            if rec is None:
                out.append(f"{r}: not started")
            elif rec.phase in (COLLECTIVE, COLLECTIVE_DONE, STEP_DONE):
                behind = self.device_behind(r)
                out.append(f"{r}: {rec.phase} {rec.k}"
                           + (f" (device at {rec.dev})" if behind else ""))
            else:
                out.append(f"{r}: {rec.phase}")
        return tuple(out)

    def judge(self, now: float) -> Stall | None:
        p = self.policy
        n = len(self.paths)
        if n == 0:
            return None
        recs = self.records

        def stall(kind: str, phase: str, k: int, ranks: Sequence[int], waited: float,
                  limit: float) -> Stall:
            return Stall(kind, phase, k, tuple(ranks), round(waited, 3), round(limit, 3),
                         self._positions())

        orders = [_ORDER[rec.phase] if rec is not None else -1 for rec in recs]
        # 1. communicator setup
        in_setup = [r for r in range(n) if orders[r] == _ORDER[COMM_SETUP]]
        if in_setup:
            arrived = [t for t in self._setup_at if t is not None]
            if len(arrived) == n:
                waited = now - max(arrived)
                if waited > p.setup_grace_s:
                    return stall("setup", COMM_SETUP, 0, in_setup, waited, p.setup_grace_s)
            else:
                first = min(arrived)
                late = [r for r in range(n) if self._setup_at[r] is None
                        and orders[r] >= _ORDER[DEVICE_READY]]  # importing: generous allowance
                quiet = [now - max(first, self._changed_at[r]) for r in late]
                if late and min(quiet) > p.arrive_grace_s:
                    return stall("straggler", COMM_SETUP, 0, late, min(quiet), p.arrive_grace_s)
            return None
        # 2. collectives: the highest one any rank has entered
        top = max(self._entered_k)
        if top > 0:
            done = self.done_on_device()
            waiting = [r for r in range(n) if self._entered_k[r] == top and done[r] < top]
            if waiting:
                late = [r for r in range(n) if self._entered_k[r] < top]
                if late:
                    first = min(self._entered_at[r][top] for r in range(n)
                                if top in self._entered_at[r])
                    quiet = [now - max(first, self._changed_at[r]) for r in late]
                    if min(quiet) > p.arrive_grace_s:
                        return stall("straggler", COLLECTIVE, top, late, min(quiet),
                                     p.arrive_grace_s)
                    return None
                last = max(self._entered_at[r][top] for r in range(n))
                limit = p.collective_grace(top, self._nbytes.get(top, 0), self._allow.get(top, 0.0),
                                           self.s_per_byte)
                if now - last > limit:
                    return stall("collective", COLLECTIVE, top, waiting, now - last, limit)
                return None
        # 3. a ready rank outside any collective, silent too long
        if p.quiet_s is not None:
            silent = [r for r in range(n)
                      if _ORDER[COMM_READY] <= orders[r] < _ORDER[FINISHED]
                      and orders[r] != _ORDER[COLLECTIVE]
                      and now - self._changed_at[r] > p.quiet_s]
            if silent:
                rec = recs[silent[0]]
                assert rec is not None
                return stall("quiet", rec.phase, rec.k, silent,
                             now - max(self._changed_at[r] for r in silent), p.quiet_s)
        return None
