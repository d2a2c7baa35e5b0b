"""The only module that starts subprocesses: a group of workers under one deadline.

Every worker gets its own session (so one ``killpg`` reaches everything it started), output to
files (a full pipe would block it), and no stdin. The group lives or dies together: when one
worker fails, a collective peer may wait for it forever, so the rest are stopped at once.
Stopping is SIGTERM to each process group, a bounded wait, SIGKILL, a bounded wait, and reaping.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Protocol

from ..core.knowledge import nccldiag
from ..core.values.outcome import WorkerOutcome
from ..machine import files
from ..machine import procs as proc_stat
from ..records.progress import Stall, StallPolicy, StallWatcher
from .cost import CpuShare

_STDERR_TAIL_BYTES = 64 << 10
#: How much of a worker's stdout is scanned for NCCL's diagnostics reports (printed at
#: communicator init, near the start; an NCCL INFO log of 8 GPUs is far smaller).
_STDOUT_SCAN_BYTES = 4 << 20
_REPORT_MAX_BYTES = 1 << 20


@dataclass(frozen=True)
class WorkerCommand:
    """One worker: its full argv and environment, where it runs, and where it writes its report."""

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    report_path: str
    progress_path: str = ""  # where the worker writes its progress records ("" when it does not)


class Proc(Protocol):
    """What the runner needs of a started worker: ``subprocess.Popen`` or a child forked from
    this process (`probing.forkserver.ChildProc`). ``pid`` is also its process group id."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...


#: Starts one worker (`probing.forkserver.Starter`): the command, its stdout and stderr paths.
#: An OSError from it makes the runner start that worker as a fresh process instead.
Spawn = Callable[[WorkerCommand, str, str], Proc]


@dataclass(frozen=True)
class GroupOutcome:
    """What happened to a group: one outcome per command, in order (``rank`` is the index)."""

    outcomes: tuple[WorkerOutcome, ...]
    elapsed_s: float
    timed_out: bool
    pids: tuple[int, ...]  # each worker's pid, which is also its process group id
    stall: Stall | None = None  # the stall that made the runner stop the group, if one did
    stopped: str = ""  # why ``stop`` ended the group early ("" when it did not)
    started_at: float = 0.0  # time.monotonic() when the first worker was started
    #: what the workers still running got of the host when the deadline or a stall cut them
    #: (None when neither did, or nothing could be read): `cost.host_busy` judges it
    share: CpuShare | None = None


def run_group(
    commands: Sequence[WorkerCommand],
    timeout_s: float,
    *,
    poll_s: float = 0.05,
    grace_s: float = 2.0,
    shm_dir: str = "/dev/shm",
    stall_policy: StallPolicy | None = None,
    spawn: Spawn | None = None,
    stop: Callable[[], str] | None = None,
) -> GroupOutcome:
    """Run all commands at once until all exit 0, one fails, ``timeout_s`` passes, or (with
    ``stall_policy``) the workers' progress records show a stall (see `progress`).

    On a failure or the deadline every worker still running is stopped; on any exception (also
    KeyboardInterrupt) too, before it propagates. Nothing is left running or unreaped.
    ``poll_s`` is the polling interval where pidfds are unavailable, and how often progress
    records are read; ``spawn`` starts workers another way (see `Spawn`); ``grace_s`` bounds each of
    the two waits when stopping (after SIGTERM, after SIGKILL). Shared-memory segments that NCCL
    left in ``shm_dir`` because a worker was killed mid-setup are removed (see `reap_shm`).
    ``stop``, asked about every `STOP_POLL_S`, ends the group early when it returns a
    reason (a peer node of a cross-node probe was lost: waiting out the deadline is pointless).
    """
    with terminate_as_exception(), sigchld_shielded():
        return _run_group(commands, timeout_s, poll_s, grace_s, shm_dir, stall_policy, spawn,
                          stop)


STOP_POLL_S = 0.5


class _Terminated(BaseException):
    """SIGTERM arrived while workers ran (torchrun sends it to every rank when one fails)."""


@contextlib.contextmanager
def terminate_as_exception() -> Iterator[None]:
    """While workers run, turn a default-action SIGTERM into an exception, so the cleanup in
    ``finally`` stops them and removes their files; then let the signal do what it would have
    done (terminate). A handler the user installed is left alone: if it raises, ``finally`` runs
    anyway; if it ignores the signal, nothing dies. Only the main thread can own signal
    handlers; elsewhere the workers' watchdog still ends them when this process dies. Nested, the
    outermost one acts: a caller that wraps its own temporary directory in it gets that removed
    too before the signal terminates the process."""
    if (threading.current_thread() is not threading.main_thread()
            or signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL):
        yield
        return

    def on_term(signum: int, frame: FrameType | None) -> None:
        raise _Terminated(signum)

    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    except _Terminated:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.raise_signal(signal.SIGTERM)  # terminates this process, as it would have
        raise
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def sigchld_shielded() -> Iterator[None]:
    """While workers run, a SIGCHLD handler the script installed (or SIGCHLD ignored) is set
    aside: one that reaps every child would take a worker's exit status (``subprocess`` then
    reads the lost status as 0, a crashed worker as a clean exit). A SIGCHLD that came meanwhile
    is raised again once the handler is back, so the script's own children are still reaped by
    it. Only the main thread owns handlers; elsewhere, and for a handler installed outside
    Python (which cannot be put back), nothing changes."""
    sig = getattr(signal, "SIGCHLD", None)
    held = signal.getsignal(sig) if sig is not None else None
    if (sig is None or held is None or held == signal.SIG_DFL
            or threading.current_thread() is not threading.main_thread()):
        yield
        return
    came: list[int] = []

    def note(signum: int, frame: FrameType | None) -> None:
        came.append(signum)

    signal.signal(sig, note)
    try:
        yield
    finally:
        signal.signal(sig, held)
        if came and held != signal.SIG_IGN:
            signal.raise_signal(sig)


def _run_group(
    commands: Sequence[WorkerCommand],
    timeout_s: float,
    poll_s: float,
    grace_s: float,
    shm_dir: str,
    stall_policy: StallPolicy | None = None,
    spawn: Spawn | None = None,
    stop: Callable[[], str] | None = None,
) -> GroupOutcome:
    shm_before = _shm_segments(shm_dir)
    watcher = None
    if stall_policy is not None and commands and all(c.progress_path for c in commands):
        watcher = StallWatcher([c.progress_path for c in commands], stall_policy)
    stall: Stall | None = None
    stopped_because = ""
    start = time.monotonic()
    deadline = start + timeout_s
    procs: list[Proc] = []
    first_failed: int | None = None
    timed_out = False
    waiter = _ExitWaiter(poll_s)
    share: CpuShare | None = None
    steal_before = proc_stat.read_cpu_steal()
    with files.temp_dir("rs-proc-") as tmp:
        logs = Path(tmp)
        try:
            for i, cmd in enumerate(commands):
                procs.append(start_worker(cmd, logs / f"{i}.out", logs / f"{i}.err", spawn))
                waiter.add(procs[-1])
            while True:
                codes = [p.poll() for p in procs]
                failed = [i for i, c in enumerate(codes) if c is not None and c != 0]
                if failed:  # when several: one that left no report died first, the rest echo it
                    first_failed = min(
                        failed, key=lambda i: (os.path.exists(commands[i].report_path), i))
                    break
                if all(c == 0 for c in codes):
                    break
                if watcher is not None:
                    stall = watcher.poll()
                    if stall is not None:
                        break
                left = deadline - time.monotonic()
                if left <= 0:
                    timed_out = True
                    break
                if stop is not None:
                    stopped_because = stop()
                    if stopped_because:
                        break
                    left = min(left, STOP_POLL_S)
                # every worker is this process's child (fresh or forked here): its pidfd wakes us
                waiter.wait(left if watcher is None else min(left, poll_s))
            if timed_out or stall is not None:  # read before the stop, while they still run
                share = cpu_share(procs, time.monotonic() - start, steal_before)
        finally:
            waiter.close()
            stopped = _stop(procs, grace_s)
            # killed, died mid-NCCL, or exited without tearing its communicator down (a torch
            # probe worker exits right after its report: one segment per NCCL rank is left)
            reap_shm(shm_dir, shm_before)
        elapsed = time.monotonic() - start
        outcomes = tuple(
            _outcome(i, p, cmd, logs / f"{i}.err", i in stopped, i == first_failed,
                     logs / f"{i}.out")
            for i, (p, cmd) in enumerate(zip(procs, commands, strict=True))
        )
    return GroupOutcome(outcomes, elapsed, timed_out, tuple(p.pid for p in procs), stall,
                        stopped_because, start, share)


def cpu_share(procs: Sequence[Proc], wall_s: float,
              steal_before: tuple[int, int] | None) -> CpuShare | None:
    """What the workers still running got of the host (`cost.CpuShare`): each one's CPU and
    run-queue seconds, and the share of the host's CPU time stolen since ``steal_before``; None
    when no worker's could be read."""
    got = [s for s in (proc_stat.read_sched(p.pid) for p in procs if p.poll() is None)
           if s is not None]
    if not got:
        return None
    steal = 0.0
    now = proc_stat.read_cpu_steal()
    if steal_before is not None and now is not None and now[0] > steal_before[0]:
        steal = max(0.0, (now[1] - steal_before[1]) / (now[0] - steal_before[0]))
    return CpuShare(round(wall_s, 3), tuple(round(s[0], 3) for s in got),
                    tuple(round(s[1], 3) for s in got), round(steal, 4))


def start_worker(cmd: WorkerCommand, out_path: Path, err_path: Path, spawn: Spawn | None) -> Proc:
    if spawn is not None:
        try:
            return spawn(cmd, str(out_path), str(err_path))
        except OSError:
            pass  # the fork failed (out of processes, memory): a fresh process does the same work
    return start_fresh(cmd, str(out_path), str(err_path))


def start_fresh(cmd: WorkerCommand, out_path: str, err_path: str) -> subprocess.Popen[bytes]:
    """One worker as a fresh interpreter in a session of its own (so ``killpg`` reaches it)."""
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        return subprocess.Popen(
            cmd.argv, env=dict(cmd.env), cwd=cmd.cwd, stdin=subprocess.DEVNULL,
            stdout=out, stderr=err, start_new_session=True,
        )


#: Name prefixes of the /dev/shm segments NCCL creates (shm transport and proxy buffers).
SHM_PREFIXES = ("nccl-",)


def _shm_segments(shm_dir: str, prefixes: tuple[str, ...] = SHM_PREFIXES) -> frozenset[str]:
    try:
        return frozenset(n for n in os.listdir(shm_dir) if n.startswith(prefixes))
    except OSError:
        return frozenset()


def _paths_in_use(proc_dir: str = "/proc") -> set[str]:
    """Every file some live process has mapped or open (what /proc lets us read)."""
    used: set[str] = set()
    try:
        pids = [p for p in os.listdir(proc_dir) if p.isdigit()]
    except OSError:
        return used
    for pid in pids:
        try:
            with open(os.path.join(proc_dir, pid, "maps"), encoding="utf-8", errors="replace") as f:
                for line in f:  # address perms offset dev inode [path]
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        used.add(fields[5].strip())
        except OSError:
            pass
        fd_dir = os.path.join(proc_dir, pid, "fd")
        try:
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    used.add(os.readlink(os.path.join(fd_dir, fd)))
        except OSError:
            pass
    return used


def shm_entries(shm_dir: str, prefixes: tuple[str, ...] = SHM_PREFIXES) -> frozenset[str]:
    """The names in ``shm_dir`` that start with one of ``prefixes`` now (none: unreadable)."""
    return _shm_segments(shm_dir, prefixes)


def reap_shm(shm_dir: str, before: frozenset[str],
             prefixes: tuple[str, ...] = SHM_PREFIXES) -> list[str]:
    """Remove NCCL segments (or entries starting with ``prefixes``: a training attempt's torch
    and multiprocessing files) of this user that appeared in ``shm_dir`` during a probe (its
    workers killed, or exited without tearing their communicators down) and that no live process
    maps or holds open (so never another job's). Returns them."""
    new = {name for name in _shm_segments(shm_dir, prefixes) - before
           if _mine(os.path.join(shm_dir, name))}
    if not new:
        return []
    in_use = _paths_in_use()
    mapped = _inodes_mapped()
    removed = []
    for name in sorted(new):
        path = os.path.join(shm_dir, name)
        if path in in_use or f"{path} (deleted)" in in_use or _inode(path) in mapped:
            continue
        with contextlib.suppress(OSError):
            os.unlink(path)
            removed.append(name)
    return removed


def _inodes_mapped(proc_dir: str = "/proc") -> set[tuple[int, int, int]]:
    """(device major, minor, inode) of every file some live process maps: a POSIX semaphore is
    mapped under the temporary name glibc's ``sem_open`` made it by (``sem.XXXXXX (deleted)``),
    not its own, so only its inode tells it is in use."""
    found: set[tuple[int, int, int]] = set()
    with contextlib.suppress(OSError):
        for pid in (p for p in os.listdir(proc_dir) if p.isdigit()):
            with contextlib.suppress(OSError, ValueError), open(
                    os.path.join(proc_dir, pid, "maps"), encoding="utf-8",
                    errors="replace") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6 and fields[4] != "0":
                        major, _, minor = fields[3].partition(":")
                        found.add((int(major, 16), int(minor, 16), int(fields[4])))
    return found


def _inode(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return os.major(st.st_dev), os.minor(st.st_dev), st.st_ino


def _mine(path: str) -> bool:
    try:
        return os.lstat(path).st_uid == os.getuid()
    except OSError:
        return False


class _ExitWaiter:
    """Sleep until a worker exits: at once through pidfds (Linux >= 5.3), else by polling.

    Waking at the exit, not up to a poll interval later, tells which worker failed first before
    its peers have written their echoes of the failure.
    """

    def __init__(self, poll_s: float) -> None:
        self._poll_s = poll_s
        self._poller = select.poll() if hasattr(select, "poll") else None
        self._fds: dict[int, Proc] = {}
        self._fallback = not hasattr(os, "pidfd_open") or self._poller is None

    def add(self, proc: Proc) -> None:
        if self._fallback or self._poller is None:
            return
        try:
            fd = os.pidfd_open(proc.pid)
        except OSError:  # old kernel, or a sandbox that forbids it
            self._fallback = True
            return
        self._fds[fd] = proc
        self._poller.register(fd, select.POLLIN)

    def wait(self, left_s: float) -> None:
        if self._fallback or self._poller is None:
            time.sleep(min(self._poll_s, left_s))
            return
        for fd, proc in list(self._fds.items()):
            if proc.poll() is not None:  # an exited worker's pidfd stays readable: stop watching
                self._poller.unregister(fd)
                os.close(fd)
                del self._fds[fd]
        self._poller.poll(max(1, int(left_s * 1000)))

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds.clear()


def start_supervised(argv: Sequence[str], env: Mapping[str, str], cwd: str,
                     stderr: int) -> subprocess.Popen[bytes]:
    """One long-lived worker the caller watches itself (``resilient-strategy run``'s one-process
    agent): its own session, so that `stop_groups` reaches everything it starts, no
    stdin, stdout shared with the caller's, stderr to ``stderr`` (a pipe the caller tees)."""
    return subprocess.Popen(list(argv), env=dict(env), cwd=cwd, stdin=subprocess.DEVNULL,
                            stderr=stderr, start_new_session=True)


def stop_groups(procs: Sequence[Proc], grace_s: float) -> set[int]:
    """The runner's bounded stop, for a caller's own workers: SIGTERM to each one's process
    group, ``grace_s``, SIGKILL, ``grace_s``, reaped; the indices of those that were running."""
    return _stop(procs, grace_s)


def _stop(procs: Sequence[Proc], grace_s: float) -> set[int]:
    """Stop every running worker's process group and reap; the indices of those stopped."""
    running = [i for i, p in enumerate(procs) if p.poll() is None]
    for i in running:
        _signal_group(procs[i].pid, signal.SIGTERM)
    _wait_all([procs[i] for i in running], grace_s)
    for i in running:
        if procs[i].poll() is None:
            _signal_group(procs[i].pid, signal.SIGKILL)
    _wait_all([procs[i] for i in running], grace_s)
    for p in procs:  # whatever a worker started in its own group outlives it otherwise
        _signal_group(p.pid, signal.SIGKILL)
    return set(running)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _wait_all(procs: Sequence[Proc], budget_s: float) -> None:
    end = time.monotonic() + budget_s
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.0, end - time.monotonic()))


def _outcome(
    rank: int,
    proc: Proc,
    cmd: WorkerCommand,
    err_path: Path,
    stopped: bool,
    failed_first: bool,
    out_path: Path | None = None,
) -> WorkerOutcome:
    rc = proc.returncode
    sig = -rc if rc is not None and rc < 0 else None
    return WorkerOutcome(
        rank=rank,
        returncode=None if stopped or sig is not None else rc,
        signal=sig,
        report=_read(Path(cmd.report_path), _REPORT_MAX_BYTES, tail=False),
        stderr=_read(err_path, _STDERR_TAIL_BYTES, tail=True),
        stdout=_diagnostics(out_path) if out_path is not None else "",
        killed_by_runner=stopped,
        failed_first=failed_first,
        # a forked child's status another reaper took (`forkserver.ChildProc`); Popen has none
        status_lost=getattr(proc, "status_lost", False) is True,
    )


def _diagnostics(path: Path) -> str:
    """The lines of a worker's stdout that NCCL's diagnostics printed (`nccldiag.MARK`; NCCL
    prints its reports there, amid its INFO log when ``NCCL_DEBUG=INFO``), from its first
    `_STDOUT_SCAN_BYTES` bytes."""
    text = _read(path, _STDOUT_SCAN_BYTES, tail=False)
    return "\n".join(line for line in text.splitlines() if nccldiag.MARK in line)


def _read(path: Path, limit: int, *, tail: bool) -> str:
    """Up to ``limit`` bytes of a file (its end when ``tail``), "" when it does not exist."""
    try:
        with open(path, "rb") as f:
            if tail:
                f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
            data = f.read(limit)
    except OSError:
        return ""
    return data.decode("utf-8", errors="replace")
