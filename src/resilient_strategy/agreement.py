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

With no directory given (the cache is off) the file goes to a directory of this user's own:
``$XDG_RUNTIME_DIR/resilient_strategy``, else ``<tempdir>/resilient_strategy-<uid>``, created
with mode 0700 and refused when another user owns it. Publishing prunes agreement files older
than a day. No framework is imported and no port is opened: the decision must be made before
torch initializes anything.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

from .errors import ResilientStrategyError
from .probe import ProbeResult

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
    private: bool = False  # the directory is our per-user default: it must be this user's own

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
        """The agreement file of this launch attempt (``ppid``: the launcher, default our parent)."""
        ppid = os.getppid() if ppid is None else ppid
        started = process_start_ticks(ppid, proc_root) or "na"
        run = _name_part(env.get("TORCHELASTIC_RUN_ID", "none"))
        restart = _name_part(env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        port = _name_part(env.get("MASTER_PORT", "0"))
        name = f"agree-{ppid}-{started}-{run}-{restart}-{port}-{_name_part(fingerprint)}.json"
        if directory is None:
            return cls(default_dir(env) / name, private=True)
        return cls(Path(directory) / name)

    def publish(self, payload: Mapping[str, Any], now: float | None = None) -> None:
        """Write the decision atomically (stamped ``published_at``) for the other local ranks."""
        now = time.time() if now is None else now
        self._prepare_directory()
        tmp = None
        try:
            fd, tmp = tempfile.mkstemp(prefix=".tmp-agree-", dir=self.path.parent)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({**payload, "published_at": now}, fh, allow_nan=False)
            os.replace(tmp, self.path)
            tmp = None
        except (OSError, ValueError, TypeError) as exc:
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            raise ResilientStrategyError(
                f"cannot publish the decision for the other ranks at {self.path}: {exc}. "
                f"{_ADVICE}"
            ) from exc
        self._prune(now)

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
        default: this process's start time less :data:`START_SLACK_S`, read from ``proc_root``
        (no check when it cannot be read). Pass ``-math.inf`` to accept any.
        """
        floor = not_before
        if floor is None:
            started = process_start_time(proc_root)
            floor = -math.inf if started is None else started - START_SLACK_S
        if self.private:
            self._prepare_directory()
        deadline = time.monotonic() + timeout_s
        stale: float | None = None
        while True:
            data = self._read()
            if data is not None:
                published = data.get("published_at")
                if _is_number(published) and published >= floor:
                    return _checked(data, self.path)
                stale = published if _is_number(published) else math.nan
            if time.monotonic() >= deadline:
                seen = (
                    f"; the only decision there was published at {stale} (epoch seconds), before "
                    "this process started, by an earlier launch"
                    if stale is not None else ""
                )
                raise AgreementTimeoutError(
                    f"local rank 0 published no decision within {timeout_s:g} s ({self.path})"
                    f"{seen}; it may have crashed: see its log"
                )
            time.sleep(poll_s)

    # ----- internals -------------------------------------------------------------------------
    def _read(self) -> dict[str, Any] | None:
        """The file's JSON object; None while there is none (or none whole)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return None
        except ValueError:  # not JSON (UnicodeDecodeError is one too): wait for rank 0's file
            return None
        except OSError as exc:
            raise ResilientStrategyError(
                f"cannot read the decision of local rank 0 at {self.path}: {exc}. {_ADVICE}"
            ) from exc
        return data if isinstance(data, dict) else None

    def _prepare_directory(self) -> None:
        directory = self.path.parent
        try:
            directory.mkdir(mode=0o700 if self.private else 0o777, parents=True, exist_ok=True)
            if not self.private:
                return
            st = os.lstat(directory)
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                raise ResilientStrategyError(
                    f"{directory} is not a directory of this user (uid {os.getuid()}), so the "
                    "decision shared by the local ranks cannot be trusted there. Remove it, "
                    f"or {_WHERE}"
                )
            if stat.S_IMODE(st.st_mode) & 0o077:
                os.chmod(directory, 0o700)
        except OSError as exc:
            raise ResilientStrategyError(
                f"cannot use {directory} for the decision shared by the local ranks: {exc}. "
                f"{_ADVICE}"
            ) from exc

    def _prune(self, now: float) -> None:
        """Remove agreement files older than :data:`PRUNE_AFTER_S` (best-effort)."""
        with contextlib.suppress(OSError):
            for old in self.path.parent.glob("agree-*.json"):
                with contextlib.suppress(OSError):
                    if old != self.path and now - old.stat().st_mtime > PRUNE_AFTER_S:
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


def _is_number(value: Any) -> TypeGuard[float]:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)


def _checked(data: dict[str, Any], path: Path) -> dict[str, Any]:
    """The payload, once its results can be read (else a typed error, not a raw ValueError)."""
    try:
        results = data.get("results", {})
        if not isinstance(results, dict):
            raise ValueError("'results' is not an object")
        for value in results.values():
            ProbeResult.from_dict(value)
        if not (data.get("chosen") is None or isinstance(data["chosen"], str)):
            raise ValueError("'chosen' is not a candidate key")
    except ValueError as exc:
        raise ResilientStrategyError(
            f"local rank 0 published a decision this rank cannot read ({path}: {exc}); run the "
            "same version of resilient_strategy on every rank"
        ) from exc
    return data
