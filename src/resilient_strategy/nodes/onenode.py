"""One decision per node under a launcher: local rank 0 publishes, the others wait for it.

The rendezvous is a JSON file, written atomically, whose name identifies this launch attempt: the
launcher's process id and start time (every local rank shares the launcher as its parent; the
start time tells a reused process id apart), TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT
(torchrun --max-restarts starts the workers again under the same parent), MASTER_PORT, and the
machine fingerprint. As a second guard, a waiting rank ignores a file published before it was
started itself (less a few seconds of slack: the launcher starts its workers together), so a
decision left by an earlier attempt is never taken for this one. The start time comes from
``/proc/self/stat`` (field 22, in clock ticks after boot) plus the boot time in ``/proc/stat``;
where /proc cannot tell, only the file name separates attempts.

The directory is the cache directory, else (the cache is off, or its directory cannot be used:
unwritable, another user's, open to others) a directory of this user's own:
``$XDG_RUNTIME_DIR/resilient_strategy``, else ``<tempdir>/resilient_strategy-<uid>``. Either way
it must be this user's own (`files`): created 0700, and refused when another user owns it,
when group or others can write to it, or when it is another user's symlink. The file must be a
regular file of this user, opened without following symlinks; its payload is checked like a cache
entry before any rank acts on it. Every local rank reaches the same directory by the same checks.

A cache directory that passes those checks may still refuse the file when rank 0 publishes: its
disk is full, its quota spent, its filesystem read-only (`NoSpaceError`), or this user may not
write into it. That is the cache's logged degrade, never the job's failure: rank 0 publishes the
same name in the per-user directory above (``fallback``, checked the same way), says so once,
and every waiting rank reads both places, so the ranks still agree.

Cleanup: each waiting rank marks that it has read the decision (``<file>.read-<local rank>``); the
last of the ``LOCAL_WORLD_SIZE - 1`` readers removes the file and the marks. With one local rank
nothing is written. Publishing also prunes agreement files older than a day (launches that died
before every rank read). No framework is imported and no port is opened: the decision must be
made before torch initializes anything.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from ..core.measures.probe import ProbeResult
from ..errors import FileFormatError, NoSpaceError, ResilientStrategyError, UnsafePathError
from ..machine import files

log = logging.getLogger("resilient_strategy")

#: A waiting rank accepts a decision published at most this long before it started itself.
START_SLACK_S = 5.0
#: Publishing removes agreement files older than this (they belong to long-finished launches).
PRUNE_AFTER_S = 24 * 3600.0
PROC = Path("/proc")


class AgreementTimeoutError(ResilientStrategyError):
    """Local rank 0 did not publish a decision in time."""


@dataclass(frozen=True)
class Agreement:
    path: Path
    #: This rank's local rank, and how many local ranks read the decision (LOCAL_WORLD_SIZE - 1,
    #: else WORLD_SIZE - 1; None when unknown: the file is then left to the pruning by age).
    local_rank: int = 0
    readers: int | None = None
    #: the same name in this user's own directory (`default_dir`): where rank 0 publishes when
    #: ``path``'s directory (the cache's) cannot take the file, and where every reader looks too;
    #: None when ``path`` is there already
    fallback: Path | None = None

    @classmethod
    def for_job(
        cls,
        env: Mapping[str, str],
        fingerprint: str,
        directory: Path | None,
        *,
        ppid: int | None = None,
        proc_root: Path = PROC,
    ) -> Agreement:
        """The agreement file of this launch attempt (``ppid``: the launcher, default our parent).

        ``directory`` (the cache directory) is used when it is this user's own and can be
        created; otherwise the per-user default, with a warning naming why.
        """
        ppid = os.getppid() if ppid is None else ppid
        started = process_start_ticks(ppid, proc_root) or "na"
        run = _name_part(env.get("TORCHELASTIC_RUN_ID", "none"))
        restart = _name_part(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        port = _name_part(env.get("MASTER_PORT", "0"))
        name = f"agree-{ppid}-{started}-{run}-{restart}-{port}-{_name_part(fingerprint)}.json"
        where = default_dir(env)
        if directory is not None:
            try:
                files.ensure_private_dir(Path(directory))
                where = Path(directory)
            except (UnsafePathError, OSError) as exc:
                files.warn_once(
                    f"agree-dir:{directory}",
                    f"cannot share the decision between local ranks through {directory} ({exc}); "
                    f"using {where} instead",
                )
        # torchrun sets LOCAL_WORLD_SIZE; without it the planner takes the job for one node
        local = _int(env.get("LOCAL_WORLD_SIZE")) or _int(env.get("WORLD_SIZE"))
        own = default_dir(env)
        return cls(where / name, local_rank=_int(env.get("LOCAL_RANK")) or 0,
                   readers=None if local is None else max(0, local - 1),
                   fallback=None if where == own else own / name)

    def publish(self, payload: Mapping[str, Any], now: float | None = None) -> Path | None:
        """Write the decision atomically (stamped ``published_at``) for the other local ranks;
        nothing when no other local rank reads it. Where it was written: ``path``, else (that
        directory full, read-only or not writable: logged once) ``fallback``; None when nothing
        was written."""
        if self.readers == 0:
            return None
        now = time.time() if now is None else now
        try:
            self._write(self.path, payload, now)
            return self.path
        except (NoSpaceError, OSError) as exc:
            if self.fallback is None:
                raise ResilientStrategyError(
                    f"cannot publish the decision for the other ranks at {self.path}: {exc}. "
                    f"{_ADVICE}") from exc
            moved = exc
        try:
            self._write(self.fallback, payload, now)
        except (NoSpaceError, OSError) as exc:
            raise ResilientStrategyError(
                f"cannot publish the decision for the other ranks at {self.path} ({moved}) nor "
                f"at {self.fallback} ({exc}). {_ADVICE}") from exc
        files.warn_once(
            f"agree-moved:{self.path.parent}",
            f"cannot write the decision for the other local ranks in {self.path.parent} "
            f"({moved}); shared through {self.fallback.parent} instead (the cache directory "
            "is not writable: free space there, or point RESILIENT_STRATEGY_CACHE_DIR at a disk "
            "with room)")
        return self.fallback

    def _write(self, path: Path, payload: Mapping[str, Any], now: float) -> None:
        """``payload`` as the agreement file at ``path``: its directory checked first (an unsafe
        one is a typed error, never a place to move to), then written atomically. NoSpaceError or
        OSError when the directory cannot take it."""
        self._prepare_directory(path.parent, raw=True)
        for mark in self._marks(path):  # left by an earlier attempt of the same name
            mark.unlink()
        try:
            files.write_json_atomic(path, {**payload, "published_at": now}, durable=False)
        except (ValueError, TypeError) as exc:  # what JSON cannot hold: no other place helps
            raise ResilientStrategyError(
                f"cannot publish the decision for the other ranks at {path}: {exc}") from exc
        self._prune(path, now)

    def wait(
        self,
        timeout_s: float,
        poll_s: float = 0.1,
        *,
        not_before: float | None = None,
        proc_root: Path = PROC,
    ) -> dict[str, Any]:
        """The decision local rank 0 published for this launch, once it is there.

        ``not_before``: ignore a decision published before this time (``time.time()`` seconds);
        default: this process's start time less `START_SLACK_S`, read from ``proc_root``
        (no check when it cannot be read). Pass ``-math.inf`` to accept any.
        """
        floor = not_before
        if floor is None:
            started = process_start_time(proc_root)
            floor = -math.inf if started is None else started - START_SLACK_S
        self._prepare_directory(self.path.parent)
        deadline = time.monotonic() + timeout_s
        stale: float | None = None
        problem = ""
        while True:
            for where in self._places():
                data, problem = self._read(where)
                if data is None:
                    continue
                published = data.get("published_at")
                if _is_number(published) and published >= floor:
                    checked = _checked(data, where)
                    if where != self.path:
                        log.info("resilient_strategy: the decision of local rank 0 was shared "
                                 "through %s (%s could not take it)", where, self.path.parent)
                    self._mark_read(where)
                    return checked
                stale = published if _is_number(published) else math.nan
            if time.monotonic() >= deadline:
                seen = (
                    f"; the only decision there was published at {stale} (epoch seconds), before "
                    "this process started, by an earlier launch"
                    if stale is not None else f"; the file there was refused: {problem}"
                    if problem else ""
                )
                raise AgreementTimeoutError(
                    f"local rank 0 published no decision within {timeout_s:g} s ({self.path})"
                    f"{seen}; it may have crashed: see its log"
                )
            time.sleep(poll_s)

    # ----- internals -------------------------------------------------------------------------
    def _places(self) -> list[Path]:
        """Where a reader looks: ``path``, then ``fallback`` while its directory is this user's
        own (absent: nothing there yet; unsafe: said once, never read)."""
        if self.fallback is None:
            return [self.path]
        try:
            files.check_private_dir(self.fallback.parent)
        except FileNotFoundError:
            return [self.path]
        except (UnsafePathError, OSError) as exc:
            files.warn_once(f"agree-fallback:{self.fallback.parent}", str(exc))
            return [self.path]
        return [self.path, self.fallback]

    def _read(self, path: Path) -> tuple[dict[str, Any] | None, str]:
        """The file's JSON object; None while there is none (or none whole, or none of ours),
        with why when the file there was refused."""
        try:
            data = files.read_json(path, max_bytes=files.MAX_AGREEMENT_BYTES)
        except FileNotFoundError:
            return None, ""
        except UnsafePathError as exc:
            if exc.problem == files.NOT_REGULAR:  # rank 0 cannot replace it either
                raise ResilientStrategyError(
                    f"cannot read the decision of local rank 0: {exc}") from exc
            # another user's file: rank 0's atomic replace will take its place
            files.warn_once(f"agree:{path}", str(exc))
            return None, str(exc)
        except FileFormatError as exc:  # not JSON, too large or too deep: wait for rank 0's file
            return None, str(exc)
        except OSError as exc:
            raise ResilientStrategyError(
                f"cannot read the decision of local rank 0 at {path}: {exc}. {_ADVICE}"
            ) from exc
        return (data, "") if isinstance(data, dict) else (None, "not a JSON object")

    @staticmethod
    def _prepare_directory(directory: Path, *, raw: bool = False) -> None:
        """``directory`` made (0700) and checked as this user's own. An unsafe one is a typed
        error; one that cannot be created is too, or (``raw``) the OSError itself, for a caller
        that has another place to go."""
        try:
            files.ensure_private_dir(directory, fix=f"Remove it, or {_WHERE}.")
        except UnsafePathError as exc:
            raise ResilientStrategyError(
                f"the decision shared by the local ranks cannot be trusted there: {exc}"
            ) from exc
        except OSError as exc:
            if raw:
                raise
            raise ResilientStrategyError(
                f"cannot use {directory} for the decision shared by the local ranks: {exc}. "
                f"{_ADVICE}"
            ) from exc

    @staticmethod
    def _marks(path: Path) -> list[Path]:
        return list(path.parent.glob(f"{path.name}.read-*"))

    def _mark_read(self, path: Path) -> None:
        """Say that this rank has read the decision at ``path``; the last reader removes file
        and marks."""
        if self.readers is None:
            return
        try:
            fd = files.open_lock(path.with_name(f"{path.name}.read-{self.local_rank}"))
            os.close(fd)
            if len(self._marks(path)) >= self.readers:
                for leftover in (path, *self._marks(path)):
                    with contextlib.suppress(FileNotFoundError):
                        leftover.unlink()
        except OSError as exc:  # the file is pruned by age then
            log.info("resilient_strategy: cannot clean up %s (%s)", path, exc)

    @staticmethod
    def _prune(path: Path, now: float) -> None:
        """Remove agreement files (and their read marks) older than `PRUNE_AFTER_S`."""
        with contextlib.suppress(OSError):
            for old in [*path.parent.glob("agree-*.json*"), *path.parent.glob(".tmp-*.json")]:
                with contextlib.suppress(OSError):
                    st = old.lstat()
                    if (not old.name.startswith(path.name) and st.st_uid == os.geteuid()
                            and now - st.st_mtime > PRUNE_AFTER_S):
                        old.unlink()


_WHERE = ("set XDG_RUNTIME_DIR, or turn the cache on with RESILIENT_STRATEGY_CACHE_DIR (or "
          "cache_dir=) naming a directory of your own")
_ADVICE = f"Make that directory writable, or {_WHERE}."


def default_dir(env: Mapping[str, str]) -> Path:
    """This user's directory for agreement files when no cache directory is given."""
    if env.get("XDG_RUNTIME_DIR"):
        return Path(env["XDG_RUNTIME_DIR"]) / "resilient_strategy"
    return Path(tempfile.gettempdir()) / f"resilient_strategy-{os.getuid()}"


def process_start_ticks(pid: int | str, proc_root: Path = PROC) -> str:
    """Field 22 of ``/proc/<pid>/stat`` (start time, clock ticks after boot); "" when unreadable."""
    try:
        text = (proc_root / str(pid) / "stat").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""
    # "pid (comm) state ...": comm may hold spaces and parentheses, so split after the last ")".
    rest = text.rpartition(")")[2].split()
    ticks = rest[19] if len(rest) > 19 else ""  # rest[0] is field 3
    return ticks if ticks.isdigit() else ""


def process_start_time(proc_root: Path = PROC, pid: int | str = "self") -> float | None:
    """When a process started, in ``time.time()`` seconds (to about 1 s); None when unknown."""
    ticks = process_start_ticks(pid, proc_root)
    if not ticks:
        return None
    try:
        boot = next(
            float(line.split()[1])
            for line in (proc_root / "stat").read_text(encoding="utf-8").splitlines()
            if line.startswith("btime ")
        )
        hz = os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return boot + int(ticks) / hz if hz > 0 else None


def _name_part(value: str) -> str:
    """A launcher value made safe for a file name."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", value)[:64] or "_"


def _int(value: str | None) -> int | None:
    try:
        return int(value) if value else None
    except ValueError:
        return None


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _checked(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The payload, once every field a follower uses is what publish() writes (else a typed
    error, never a raw KeyError or ValueError)."""
    try:
        results = data.get("results")
        if not isinstance(results, dict):
            raise ValueError("'results' is not an object")
        for key, value in results.items():
            if ProbeResult.from_dict(value).candidate != key:
                raise ValueError(f"the result under {key!r} is another candidate's")
        if "chosen" not in data or not (data["chosen"] is None or isinstance(data["chosen"], str)):
            raise ValueError("'chosen' is not a candidate key")
        for flag in ("from_cache", "proven"):
            if not isinstance(data.get(flag), bool):
                raise ValueError(f"{flag!r} is not true or false")
    except ValueError as exc:
        raise ResilientStrategyError(
            f"local rank 0 published a decision this rank cannot read ({path}: {exc}); run the "
            "same version of resilient_strategy on every rank"
        ) from exc
    return data


# --------------------------------------------------------------------------------------------
# The GPUs each local rank sees, shared before the decision (a scheduler binds them per task)
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GpuExchange:
    """Every local rank writes the GPUs it sees (``<stem>-<local rank>.json``, atomically, in
    the agreement's directory) and reads every other rank's: SLURM's ``--gpus-per-task`` shows
    each task its own GPUs, so no rank can assume the others see what it sees. The names carry
    the launch as the agreement's do (the launcher's process id and start time, its run id,
    restart count and port), but no machine fingerprint: the ranks' own differ, by the GPUs they
    see. Each rank marks that it has read them all; the last removes the files and marks. A rank
    whose file the directory cannot take (a full or read-only cache disk) writes it in this
    user's own directory (``fallback``), where every rank also looks, as the agreement does."""

    directory: Path
    stem: str
    local_rank: int
    local_world: int
    fallback: Path | None = None

    @classmethod
    def for_job(cls, env: Mapping[str, str], directory: Path | None, local_rank: int,
                local_world: int, *, ppid: int | None = None,
                proc_root: Path = PROC) -> GpuExchange:
        ppid = os.getppid() if ppid is None else ppid
        started = process_start_ticks(ppid, proc_root) or "na"
        run = _name_part(env.get("TORCHELASTIC_RUN_ID") or env.get("SLURM_JOB_ID") or "none")
        restart = _name_part(env.get("TORCHELASTIC_RESTART_COUNT")
                             or env.get("SLURM_STEP_ID") or "0")
        port = _name_part(env.get("MASTER_PORT", "0"))
        agreement = Agreement.for_job(env, "gpus", directory, ppid=ppid, proc_root=proc_root)
        return cls(agreement.path.parent, f"agree-gpus-{ppid}-{started}-{run}-{restart}-{port}",
                   local_rank, local_world,
                   None if agreement.fallback is None else agreement.fallback.parent)

    def _path(self, rank: int, suffix: str = "json", directory: Path | None = None) -> Path:
        return (directory or self.directory) / f"{self.stem}-{rank}.{suffix}"

    def _write(self, directory: Path, mine: list[dict[str, Any]], now: float | None) -> None:
        try:
            files.ensure_private_dir(directory, fix=f"Remove it, or {_WHERE}.")
        except UnsafePathError as exc:
            raise ResilientStrategyError(
                f"the GPUs shared by the local ranks cannot be trusted there: {exc}") from exc
        try:
            files.write_json_atomic(self._path(self.local_rank, directory=directory),
                                    {"gpus": mine, "published_at": time.time() if now is None
                                     else now}, durable=False)
        except (ValueError, TypeError) as exc:
            raise ResilientStrategyError(
                f"cannot share this rank's GPUs at {directory}: {exc}") from exc

    def _places(self) -> list[Path]:
        """Where the ranks' files are looked for: the directory, then the fallback while it is
        this user's own."""
        if self.fallback is None:
            return [self.directory]
        try:
            files.check_private_dir(self.fallback)
        except (UnsafePathError, OSError):
            return [self.directory]
        return [self.directory, self.fallback]

    def share(self, mine: list[dict[str, Any]], timeout_s: float, poll_s: float = 0.05, *,
              not_before: float | None = None, proc_root: Path = PROC,
              now: float | None = None) -> list[list[dict[str, Any]]]:
        """Write this rank's GPUs (``mine``: `Gpu` values as dicts), then wait for every local
        rank's; per local rank, in order, the GPUs it sees."""
        floor = not_before
        if floor is None:
            started = process_start_time(proc_root)
            floor = -math.inf if started is None else started - START_SLACK_S
        try:
            self._write(self.directory, mine, now)
        except (NoSpaceError, OSError) as exc:
            if self.fallback is None:
                raise ResilientStrategyError(
                    f"cannot share this rank's GPUs with the other local ranks at "
                    f"{self.directory}: {exc}. {_ADVICE}") from exc
            try:
                self._write(self.fallback, mine, now)
            except (NoSpaceError, OSError) as again:
                raise ResilientStrategyError(
                    f"cannot share this rank's GPUs with the other local ranks at "
                    f"{self.directory} ({exc}) nor at {self.fallback} ({again}). {_ADVICE}"
                ) from again
            files.warn_once(f"agree-moved:{self.directory}",
                            f"cannot write this rank's GPUs in {self.directory} ({exc}); shared "
                            f"through {self.fallback} instead")
        deadline = time.monotonic() + timeout_s
        seen: dict[int, list[dict[str, Any]]] = {}
        while True:
            for rank in range(self.local_world):
                if rank not in seen:
                    got = self._read(rank, floor)
                    if got is not None:
                        seen[rank] = got
            if len(seen) == self.local_world:
                self._done()
                return [seen[r] for r in range(self.local_world)]
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.local_world)) - set(seen))
                raise AgreementTimeoutError(
                    f"local rank(s) {missing} did not say which GPUs they see within "
                    f"{timeout_s:g} s ({self.directory}/{self.stem}-*.json); they may have "
                    "crashed: see their logs")
            time.sleep(poll_s)

    def _read(self, rank: int, floor: float) -> list[dict[str, Any]] | None:
        for where in self._places():
            got = self._read_at(rank, floor, where)
            if got is not None:
                return got
        return None

    def _read_at(self, rank: int, floor: float, where: Path) -> list[dict[str, Any]] | None:
        path = self._path(rank, directory=where)
        try:
            data = files.read_json(path, max_bytes=files.MAX_AGREEMENT_BYTES)
        except (FileNotFoundError, FileFormatError, UnsafePathError):
            return None
        except OSError as exc:
            raise ResilientStrategyError(
                f"cannot read the GPUs of local rank {rank} at {path}: {exc}") from exc
        if not isinstance(data, dict) or not _is_number(data.get("published_at")) \
                or data["published_at"] < floor:
            return None
        gpus = data.get("gpus")
        if not isinstance(gpus, list) or not all(isinstance(g, dict) for g in gpus):
            raise ResilientStrategyError(
                f"local rank {rank} wrote GPUs this rank cannot read ({path}); run "
                "the same version of resilient_strategy on every rank")
        return gpus

    def _done(self) -> None:
        """Mark this rank's reading (in the first place that takes the mark); the rank that
        sees every mark removes the files and marks, wherever they are."""
        places = self._places()
        marked = False
        for where in places:
            try:
                os.close(files.open_lock(self._path(self.local_rank, "json.read", where)))
                marked = True
                break
            except OSError as exc:
                log.info("resilient_strategy: cannot mark the GPUs read in %s (%s)", where, exc)
        if not marked:  # pruned by age then
            return
        marks = {m.name for where in places for m in where.glob(f"{self.stem}-*.json.read")}
        if len(marks) >= self.local_world:
            for where in places:
                for rank in range(self.local_world):
                    for suffix in ("json", "json.read"):
                        with contextlib.suppress(OSError):
                            self._path(rank, suffix, where).unlink()
