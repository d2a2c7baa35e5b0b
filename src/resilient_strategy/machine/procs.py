"""A process seen from outside: its scheduler state and the CPU time it has used, from
``/proc/<pid>/stat`` (Linux). The supervisor reads it for every rank it watches, so that a
rank that is stopped (``SIGSTOP``, a debugger), in uninterruptible sleep, blocked, or busy in
its own code is told apart without asking the rank anything.

`parse_stat` is pure and tested from strings; `read_stat` is the thin reader (None
where the file cannot be read: another OS, a process gone). The CPU time a process got and the
time it waited for one (``/proc/<pid>/task/*/schedstat``: on-CPU and run-queue nanoseconds, each
thread), and the host's stolen time (``/proc/stat``'s ``cpu`` line), are parsed the same way:
a probe cut at its deadline on a saturated host is judged by them (`probing.cost.host_busy`). `pids_with_env` finds the
processes whose environment holds a variable (``/proc/<pid>/environ``): the benchmarks and tests
send a real signal to "the process of rank 1" this way.

Field layout: proc(5), ``/proc/[pid]/stat``: field 2 is the command in parentheses (it may hold
spaces and parentheses: the last ``)`` ends it), field 3 the state (R running, S sleeping, D
uninterruptible disk sleep, Z zombie, T stopped by a signal, t stopped by a tracer, X dead, I
idle kernel thread), fields 14 and 15 ``utime`` and ``stime`` in clock ticks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

#: The states of a process that will not run until someone continues it.
STOPPED_STATES = frozenset("Tt")
#: The states of a process that is gone.
GONE_STATES = frozenset("ZX")
#: The most of a stat or environ file read (a stat line is under 1 KiB; an environment may be
#: large, but the variable sought is looked for in the first MiB).
MAX_STAT_BYTES = 4096
MAX_ENVIRON_BYTES = 1 << 20


@dataclass(frozen=True)
class ProcStat:
    """One reading of a process: its state letter, its CPU time (user + system, every thread)
    in ticks, and its parent's pid (0: not read)."""

    pid: int
    state: str
    cpu_ticks: int
    ppid: int = 0

    @property
    def stopped(self) -> bool:
        return self.state in STOPPED_STATES

    @property
    def gone(self) -> bool:
        return self.state in GONE_STATES

    @property
    def uninterruptible(self) -> bool:
        return self.state == "D"


def parse_stat(text: str) -> ProcStat | None:
    """The state and CPU time in one ``/proc/<pid>/stat`` line; None when it is not one."""
    open_at, close_at = text.find("("), text.rfind(")")
    if open_at < 1 or close_at < open_at:
        return None
    try:
        pid = int(text[:open_at].strip())
    except ValueError:
        return None
    rest = text[close_at + 1:].split()
    # rest[0] is field 3 (state), rest[1] field 4 (ppid); utime and stime are fields 14 and
    # 15: rest[11], rest[12]
    if len(rest) < 13 or len(rest[0]) != 1:
        return None
    try:
        return ProcStat(pid, rest[0], int(rest[11]) + int(rest[12]), int(rest[1]))
    except ValueError:
        return None


def read_stat(pid: int, root: str = "/proc") -> ProcStat | None:
    """``pid``'s state now; None when it cannot be read (no /proc, the process gone)."""
    try:
        with open(f"{root}/{int(pid)}/stat", "rb") as fh:
            return parse_stat(fh.read(MAX_STAT_BYTES).decode("ascii", "replace"))
    except (OSError, ValueError):
        return None


#: The most processes one tree's CPU time counts (`tree_ticks`): a rank with its DataLoader
#: workers and what they started has tens.
MAX_TREE = 4096


def tree_ticks(pids: Iterable[int], root: str = "/proc") -> dict[int, int]:
    """For each of ``pids``, the CPU ticks it and every live process below it (its children,
    theirs: DataLoader workers, a compiler, anything it started) have used, from one pass over
    ``root``; a pid that cannot be read is left out. A process whose CPU time does not move
    while one it started works is not idle: the tree's total says so."""
    stats = [st for pid in _pids(root) if (st := read_stat(pid, root)) is not None]
    return sum_tree(pids, stats)


def sum_tree(pids: Iterable[int], stats: Iterable[ProcStat]) -> dict[int, int]:
    """`tree_ticks` from readings already taken (pure): each of ``pids`` that is among
    ``stats``, with the ticks of every process below it (at most `MAX_TREE` each)."""
    by_pid = {st.pid: st for st in stats}
    children: dict[int, list[int]] = {}
    for st in by_pid.values():
        children.setdefault(st.ppid, []).append(st.pid)
    out: dict[int, int] = {}
    for pid in pids:
        if pid not in by_pid:
            continue
        total, todo, seen = 0, [pid], set[int]()
        while todo and len(seen) < MAX_TREE:
            p = todo.pop()
            if p in seen or p not in by_pid:
                continue
            seen.add(p)
            total += by_pid[p].cpu_ticks
            todo.extend(children.get(p, ()))
        out[pid] = total
    return out


#: The most threads of one process whose ``schedstat`` is read (a torch worker has tens).
MAX_TASKS = 512


def parse_schedstat(text: str) -> tuple[int, int] | None:
    """(nanoseconds on a CPU, nanoseconds runnable and waiting on a run queue) of one
    ``/proc/<pid>/schedstat`` (or a thread's) line: "<on cpu> <waiting> <timeslices>"; None when
    it is not one. Pure."""
    fields = text.split()
    if len(fields) < 2:
        return None
    try:
        on_cpu, waited = int(fields[0]), int(fields[1])
    except ValueError:
        return None
    return (on_cpu, waited) if on_cpu >= 0 and waited >= 0 else None


def read_sched(pid: int, root: str = "/proc") -> tuple[float, float] | None:
    """(seconds on a CPU, seconds waiting for one) of every thread of ``pid`` so far; None when
    nothing can be read (no schedstat: another OS, a kernel without schedstats, the process
    gone)."""
    on_cpu = waited = 0
    seen = 0
    with contextlib.suppress(OSError, ValueError):
        for name in sorted(os.listdir(f"{root}/{int(pid)}/task"))[:MAX_TASKS]:
            with contextlib.suppress(OSError):
                with open(f"{root}/{int(pid)}/task/{name}/schedstat", "rb") as fh:
                    got = parse_schedstat(fh.read(MAX_STAT_BYTES).decode("ascii", "replace"))
                if got is not None:
                    on_cpu, waited, seen = on_cpu + got[0], waited + got[1], seen + 1
    return (on_cpu / 1e9, waited / 1e9) if seen else None


def parse_cpu_steal(text: str) -> tuple[int, int] | None:
    """(all ticks, stolen ticks) of the host's CPUs from ``/proc/stat`` (its ``cpu`` line: user
    nice system idle iowait irq softirq steal ...); None without one. Pure."""
    for line in text.splitlines():
        fields = line.split()
        if fields[:1] != ["cpu"]:
            continue
        try:
            ticks = [int(f) for f in fields[1:9]]
        except ValueError:
            return None
        if len(ticks) < 8:
            return None
        return sum(ticks), ticks[7]
    return None


def read_cpu_steal(root: str = "/proc") -> tuple[int, int] | None:
    """The host's (all ticks, stolen ticks) now; None where ``/proc/stat`` cannot be read."""
    try:
        with open(f"{root}/stat", "rb") as fh:
            return parse_cpu_steal(fh.read(MAX_ENVIRON_BYTES).decode("ascii", "replace"))
    except OSError:
        return None


def ticks_per_second() -> float:
    """The clock ticks of ``utime``/``stime`` per second (``SC_CLK_TCK``; 100 where unknown)."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        ticks = os.sysconf("SC_CLK_TCK")
        if ticks > 0:
            return float(ticks)
    return 100.0


def parse_environ(data: bytes) -> dict[str, str]:
    """A ``/proc/<pid>/environ`` file (NUL-separated ``NAME=value``) as a mapping. Pure."""
    out: dict[str, str] = {}
    for item in data.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name:
            out[name.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def _pids(root: str) -> Iterator[int]:
    with contextlib.suppress(OSError):
        for name in os.listdir(root):
            if name.isdigit():
                yield int(name)


def pids_with_env(wanted: Mapping[str, str], root: str = "/proc") -> list[int]:
    """The processes (of this user: others' environments are not readable) whose environment
    sets every variable in ``wanted`` to its value, sorted. The environment is the one the
    process started with."""
    found = []
    for pid in _pids(root):
        try:
            with open(f"{root}/{pid}/environ", "rb") as fh:
                env = parse_environ(fh.read(MAX_ENVIRON_BYTES))
        except OSError:
            continue
        if all(env.get(k) == v for k, v in wanted.items()):
            found.append(pid)
    return sorted(found)


def could_be_pid(pid: int) -> bool:
    """Whether ``pid`` is a number a process can have (``pid_t``, a signed 32-bit integer, and
    positive: ``kill`` of 0 or less signals a process group), pure."""
    return 0 < pid < 1 << 31


def alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts: it cannot be signalled). A
    number no process can have (`could_be_pid`) is not one."""
    if not could_be_pid(pid):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: another user's; anything else: not known to be gone
        return True
    return True


@dataclass(frozen=True)
class ProcIds:
    """Who a process is beside: its parent, its process group and its session (``stat``'s
    fields 4, 5 and 6), with its state letter."""

    pid: int
    ppid: int
    pgrp: int
    session: int
    state: str

    @property
    def gone(self) -> bool:
        return self.state in GONE_STATES


def parse_ids(text: str) -> ProcIds | None:
    """The parent, group and session in one ``/proc/<pid>/stat`` line; None when it is not one.
    Pure."""
    open_at, close_at = text.find("("), text.rfind(")")
    if open_at < 1 or close_at < open_at:
        return None
    rest = text[close_at + 1:].split()
    if len(rest) < 4 or len(rest[0]) != 1:
        return None
    try:
        return ProcIds(int(text[:open_at].strip()), int(rest[1]), int(rest[2]), int(rest[3]),
                       rest[0])
    except ValueError:
        return None


def read_ids(pid: int, root: str = "/proc") -> ProcIds | None:
    """``pid``'s parent, group and session now; None when they cannot be read."""
    try:
        with open(f"{root}/{int(pid)}/stat", "rb") as fh:
            return parse_ids(fh.read(MAX_STAT_BYTES).decode("ascii", "replace"))
    except (OSError, ValueError):
        return None


def in_sessions(sessions: Iterable[int], ids: Iterable[ProcIds],
                spare: Iterable[int] = ()) -> list[int]:
    """The live processes among ``ids`` whose session is one of ``sessions`` (each a session
    leader's pid: a rank started in a session of its own), but those in ``spare``, sorted
    (pure). A session outlives its leader: what the leader started and left behind, orphaned
    to init, is still in it, unless it started a session of its own."""
    wanted = {s for s in sessions if could_be_pid(s)}
    keep = set(spare)
    return sorted(i.pid for i in ids
                  if i.session in wanted and not i.gone and i.pid not in keep)


def session_members(sessions: Iterable[int], root: str = "/proc",
                    spare: Iterable[int] = ()) -> list[int]:
    """`in_sessions` over every process ``root`` shows now."""
    return in_sessions(sessions, (i for pid in _pids(root)
                                  if (i := read_ids(pid, root)) is not None), spare)


def parse_oom_kills(text: str) -> int | None:
    """The ``oom_kill`` counter of a cgroup's ``memory.events`` (v2), ``memory.oom_control``
    (v1) or of ``/proc/vmstat`` (the host's): the processes the kernel's OOM killer killed;
    None without one. Pure."""
    for line in text.splitlines():
        fields = line.split()
        if len(fields) == 2 and fields[0] == "oom_kill":
            with contextlib.suppress(ValueError):
                return int(fields[1])
    return None


def memory_cgroup_files(cgroup_text: str, root: str = "/sys/fs/cgroup") -> list[str]:
    """The files that may hold the ``oom_kill`` counter of the memory cgroup a
    ``/proc/<pid>/cgroup`` text names, most specific first (the cgroup's own under the v2 or
    the v1 ``memory`` hierarchy, then the hierarchy's root as a container mounts it). Pure."""
    out: list[str] = []
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        path = parts[2].strip().strip("/")
        if parts[0] == "0" and parts[1] == "":
            out += [f"{root}/{path}/memory.events".replace("//", "/"), f"{root}/memory.events"]
        elif "memory" in parts[1].split(","):
            out += [f"{root}/memory/{path}/memory.oom_control".replace("//", "/"),
                    f"{root}/memory/memory.oom_control"]
    return list(dict.fromkeys(out))


def oom_kills(proc_root: str = "/proc", cgroup_root: str = "/sys/fs/cgroup") -> int | None:
    """How many processes the kernel's OOM killer has killed so far in this process's memory
    cgroup (what its children inherit), else on the host (``/proc/vmstat``); None where neither
    can be read. A rise across an attempt is the kernel's evidence that a SIGKILL was its."""
    try:
        with open(f"{proc_root}/self/cgroup", "rb") as fh:
            cgroup = fh.read(MAX_STAT_BYTES * 4).decode("utf-8", "replace")
    except OSError:
        cgroup = ""
    for path in [*memory_cgroup_files(cgroup, cgroup_root), f"{proc_root}/vmstat"]:
        try:
            with open(path, "rb") as fh:
                found = parse_oom_kills(fh.read(MAX_ENVIRON_BYTES).decode("ascii", "replace"))
        except OSError:
            continue
        if found is not None:
            return found
    return None
