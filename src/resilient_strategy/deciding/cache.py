"""The decision cache: probe results per machine fingerprint, as JSON, written atomically.

The decision itself is not stored: the planner is pure and fast, so a cached run re-plans from
the cached results and reaches the same choice in milliseconds without probing. A changed
fingerprint (GPUs, driver, framework or NCCL version, relevant environment) is a different file,
so it re-probes. The file name carries the format version too, so two versions of this library
on one machine keep separate files instead of setting each other's aside.

Only proof is cached. A result enters the file only when a probe on this machine produced it
(`refusal` says why one may not): a failure a training process met mid-run is only a
classification of its exception text (a ``ConnectionResetError`` of the user's own code reads like
a network fault), so it is kept for the supervisor's session only and never enters the cache
(a real fault of the backend is met again by the next run's probe, which is cached as any
probe's failure is). A failure of a candidate
of last resort (one device, the CPU: no collective to prove) is never cached, so nothing cached
can leave a machine with no way to train; a failure from the machine's state (a full disk, the
descriptor limit, a permission: `ENVIRONMENTAL_CAUSES`) says
nothing about the backend and is never cached either. The same rules apply to what is read, so
an entry an older version wrote against them is ignored (``cache show`` lists it as ignored).

Every entry counts ``seen``: in how many runs in a row its candidate came out the same way
(passed, or failed). A failure seen once may have been an overloaded machine; the executor
trusts a cached failure only from the second (see `DecisionCache.entries`).

The directory must be this user's own (see `files`): created 0700 when absent; one owned by
someone else, writable by group or others, or a symlink of another user's is refused with a
warning (the cache is off for the run). A file another user planted is ignored the same way.
A corrupt or unreadable file of ours (not UTF-8, not JSON, too large or too deeply nested, or
any entry that is not what `store` writes) is set aside as ``.corrupt`` and probing runs
again; an unwritable directory is a logged degrade. Writers take an advisory lock
(``<fingerprint>.lock``, never through a symlink) around read-merge-replace so that concurrent
processes do not lose each other's results; where locking is not possible they carry on without
it. Nothing here raises to the user.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.call.options import DEFAULT_TTL_S
from ..core.measures.probe import ENVIRONMENTAL_CAUSES, HOST_BUSY, ProbeResult
from ..core.values.candidate import CandidateKey
from ..errors import FileFormatError, NoSpaceError, UnsafePathError
from ..machine import files

if sys.platform != "win32":
    import fcntl

log = logging.getLogger("resilient_strategy")

FORMAT_VERSION = 1
#: How long a writer waits for another writer's lock before it goes on without one.
LOCK_WAIT_S = 10.0


@dataclass(frozen=True)
class CachedResult:
    """One cache entry: the result, when it was stored, and in how many runs in a row its
    candidate came out the same way (passed, or failed)."""

    result: ProbeResult
    at: float
    seen: int = 1


_Entries = dict[str, CachedResult]

#: ``extra`` keys: a failure met by a training process mid-run (its step), a rehearsed fault.
MID_RUN, REHEARSAL = "mid_run", "rehearsal"


def last_resort(key: str) -> bool:
    """Whether a candidate (by key) is one of last resort: one device or the CPU, with no
    collective to prove. Its failures are never cached: it is always tried again."""
    parsed = CandidateKey.read(key)
    return parsed is None or parsed.last_resort


def refusal(result: ProbeResult) -> str | None:
    """Why this result may not be cached, or None when it may (a pass always may). Pure."""
    if result.ok:
        return None
    extra = dict(result.extra)
    if last_resort(result.candidate):
        return "a failure of a candidate of last resort (one device / CPU is always tried again)"
    if result.cause in ENVIRONMENTAL_CAUSES:
        return f"a cause of the machine's state ({result.cause}), not of the backend"
    if REHEARSAL in extra:
        return "a rehearsed fault"
    if MID_RUN in extra:
        return "a mid-run failure that no probe reproduced"
    if HOST_BUSY in extra:
        return "a deadline that passed while the host was too busy to run the probe (load, not a fault)"
    return None



@dataclass(frozen=True)
class DecisionCache:
    directory: Path
    ttl_s: float = DEFAULT_TTL_S

    def path(self, fingerprint: str) -> Path:
        return self.directory / f"{fingerprint}.v{FORMAT_VERSION}.json"

    def lock_path(self, fingerprint: str) -> Path:
        return self.directory / f"{fingerprint}.lock"

    def load(self, fingerprint: str, now: float | None = None) -> dict[str, ProbeResult]:
        """Unexpired results for this fingerprint; {} when none, expired, or unreadable.

        An entry expires when its time is more than ``ttl_s`` away from ``now`` in either
        direction: one stamped in the future (a skewed clock) must not live forever.
        """
        return {k: e.result for k, e in self.entries(fingerprint, now).items()}

    def entries(self, fingerprint: str, now: float | None = None) -> dict[str, CachedResult]:
        """Like `load`, with each entry's time and ``seen`` count. An entry that may not
        be cached (`refusal`: an older version wrote it) is left out."""
        now = time.time() if now is None else now
        return {k: e for k, e in self._read(fingerprint).items()
                if abs(now - e.at) <= self.ttl_s and refusal(e.result) is None}

    def all_entries(self, fingerprint: str) -> dict[str, CachedResult]:
        """Every valid entry of the file, expired or refused ones too (for ``cache show``)."""
        return self._read(fingerprint)

    def fingerprints(self) -> list[str]:
        """The fingerprints with a cache file of this format in the directory, sorted; [] when
        the directory is missing or not this user's own."""
        try:
            files.check_private_dir(self.directory)
            names = os.listdir(self.directory)
        except (OSError, UnsafePathError):
            return []
        suffix = f".v{FORMAT_VERSION}.json"
        return sorted(n[: -len(suffix)] for n in names
                      if n.endswith(suffix) and files.safe_name(n[: -len(suffix)]))

    def usable(self) -> bool:
        """Whether the directory is this user's own (created 0700 when absent); a warning once
        when it is not (the cache is then off)."""
        try:
            files.ensure_private_dir(self.directory)
        except UnsafePathError as exc:
            files.warn_once(f"cache-dir:{self.directory}", f"{exc} The cache is off meanwhile.")
            return False
        except OSError as exc:
            log.warning("resilient_strategy: cannot use cache directory %s (%s); continuing "
                        "without the cache", self.directory, exc)
            return False
        return True

    def store(
        self, fingerprint: str, results: Mapping[str, ProbeResult], now: float | None = None
    ) -> bool:
        """Merge these results into the file atomically; False (and a warning) when it can't.

        A result whose candidate came out the same way (passed, or failed) in the entry it
        replaces counts one more ``seen``; otherwise it starts at 1.
        """
        now = time.time() if now is None else now
        path = self.path(fingerprint)
        fresh: dict[str, ProbeResult] = {}
        for key, res in results.items():
            why = refusal(res)
            if why is not None:
                log.info("resilient_strategy: not caching the result for %s: %s", key, why)
                continue
            try:
                if ProbeResult.from_dict(res.to_dict()) != res or res.candidate != key:
                    raise ValueError("it does not survive a round trip through JSON")
            except ValueError as exc:
                log.warning("resilient_strategy: not caching the result for %s (%s)", key, exc)
                continue
            fresh[key] = res
        try:
            files.ensure_private_dir(self.directory)
        except UnsafePathError as exc:
            files.warn_once(f"cache-dir:{self.directory}", f"{exc} The cache is off meanwhile.")
            return False
        except OSError as exc:
            log.warning("resilient_strategy: cannot write cache %s (%s); continuing", path, exc)
            return False
        try:
            with self._locked(fingerprint):
                entries = {k: v for k, v in self._read(fingerprint, locked=True).items()
                           if abs(now - v.at) <= self.ttl_s and refusal(v.result) is None}
                for key, res in fresh.items():
                    old = entries.get(key)
                    seen = old.seen + 1 if old is not None and old.result.ok == res.ok else 1
                    entries[key] = CachedResult(res, now, seen)
                blob = {
                    "version": FORMAT_VERSION,
                    "fingerprint": fingerprint,
                    "results": {k: {"at": e.at, "seen": e.seen, "result": e.result.to_dict()}
                                for k, e in sorted(entries.items())},
                }
                files.write_json_atomic(path, blob, indent=1, sort_keys=True)
            return True
        except (OSError, ValueError, TypeError, NoSpaceError) as exc:
            # a full or read-only disk too: the logged degrade the cache promises, never raised
            log.warning("resilient_strategy: cannot write cache %s (%s); continuing", path, exc)
            return False

    def report(self, this_machine: str | None = None, now: float | None = None) -> dict[str, Any]:
        """What is cached, per fingerprint, as JSON-able data (``cache show``, ``doctor``): each
        entry's candidate, status, cause, ``seen``, time, whether it expired, and why it is
        ignored (`refusal`), if it is. ``this_machine``: the fingerprint to mark."""
        now = time.time() if now is None else now
        out: dict[str, Any] = {}
        for fp in self.fingerprints():
            rows = []
            for key, e in sorted(self.all_entries(fp).items()):
                rows.append({"candidate": key, "status": e.result.status, "cause": e.result.cause,
                             "detail": e.result.detail, "seen": e.seen, "at": e.at,
                             "expired": abs(now - e.at) > self.ttl_s,
                             "ignored": refusal(e.result)})
            out[fp] = {"this_machine": fp == this_machine, "path": str(self.path(fp)),
                       "entries": rows}
        return {"directory": str(self.directory), "ttl_s": self.ttl_s,
                "this_machine": this_machine, "fingerprints": out}

    def clear(self, fingerprint: str) -> bool:
        """Remove this fingerprint's file (and what was set aside of it). True when one was."""
        removed = False
        for path in (self.path(fingerprint), self.path(fingerprint).with_suffix(".corrupt"),
                     self.lock_path(fingerprint)):
            try:
                path.unlink()
            except OSError:
                continue
            removed = removed or path == self.path(fingerprint)
        return removed

    def clear_all(self) -> list[str]:
        """Remove every fingerprint's file; the fingerprints removed."""
        return [fp for fp in self.fingerprints() if self.clear(fp)]

    # ----- internals -------------------------------------------------------------------------
    def _read(self, fingerprint: str, locked: bool = False) -> _Entries:
        """Every valid entry of the file, expired or not; {} when missing or unreadable.

        A file of ours whose contents are not what `store` writes is set aside, with a
        warning; one that is not ours (or a directory that is not) is ignored, with a warning.
        ``locked``: the caller holds the lock already (flock does not nest across descriptors).
        """
        path = self.path(fingerprint)
        raw: bytes | None = None
        try:
            files.check_private_dir(self.directory)
            data = files.read_bytes(path, max_bytes=files.MAX_CACHE_BYTES)
        except FileNotFoundError:
            return {}
        except UnsafePathError as exc:
            files.warn_once(f"cache:{exc.path}", f"{exc} Probing instead of trusting it.")
            return {}
        except FileFormatError as exc:  # too large: set aside without reading it
            problem = exc.problem
        except OSError as exc:
            log.warning("resilient_strategy: cannot read cache %s (%s); probing again", path, exc)
            return {}
        else:
            try:
                return _parse(data, fingerprint, str(path))
            except FileFormatError as exc:  # the message names the path already
                raw, problem = data, exc.problem
            except ValueError as exc:
                raw, problem = data, str(exc)
        aside = self._set_aside(fingerprint, raw, locked)
        log.warning(
            "resilient_strategy: cache file %s is unreadable (%s); kept as %s, probing again",
            path, problem, aside,
        )
        return {}

    def _set_aside(self, fingerprint: str, raw: bytes | None, locked: bool) -> Path:
        """Rename a corrupt file to ``.corrupt`` (unless a writer has replaced it meanwhile;
        ``raw`` None: it was too large to compare, so compare size and time instead)."""
        path = self.path(fingerprint)
        aside = path.with_suffix(".corrupt")
        try:
            before = os.lstat(path)
            with contextlib.nullcontext() if locked else self._locked(fingerprint):
                if raw is None:
                    now = os.lstat(path)
                    same = (now.st_ino, now.st_size, now.st_mtime_ns) == (
                        before.st_ino, before.st_size, before.st_mtime_ns)
                else:
                    same = files.read_bytes(path, max_bytes=files.MAX_CACHE_BYTES) == raw
                if same and files.set_aside(path, aside):
                    return aside
        except (OSError, UnsafePathError, FileFormatError):
            pass
        return path

    @contextlib.contextmanager
    def _locked(self, fingerprint: str) -> Iterator[None]:
        """Hold the fingerprint's advisory lock, best-effort: when the lock file cannot be opened
        or locked (read-only directory, a filesystem without locks, a writer stuck for
        LOCK_WAIT_S, a symlink planted in its place), go on without it; the replace is still
        atomic, only a merge may be lost."""
        fd = None
        if sys.platform != "win32":
            try:
                fd = files.open_lock(self.lock_path(fingerprint))
                deadline = time.monotonic() + LOCK_WAIT_S
                while True:
                    try:
                        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        break
                    except BlockingIOError:
                        if time.monotonic() >= deadline:
                            raise
                        time.sleep(0.01)
            except OSError as exc:
                log.info("resilient_strategy: cache lock unavailable (%s); going on without", exc)
                if fd is not None:
                    os.close(fd)
                fd = None
        try:
            yield
        finally:
            if fd is not None:
                os.close(fd)  # closing releases the lock


def _parse(raw: bytes, fingerprint: str, where: str = "cache") -> _Entries:
    """The entries of a cache file's bytes. Raises ValueError for anything store() never wrote."""
    data: Any = files.parse_json(raw, where)  # FileFormatError is a ValueError
    if not isinstance(data, dict):
        raise ValueError(f"the top level is a {type(data).__name__}, not an object")
    if data.get("version") != FORMAT_VERSION:
        raise ValueError(f"format version {data.get('version')!r}, not {FORMAT_VERSION}")
    if data.get("fingerprint") != fingerprint:
        raise ValueError(f"written for fingerprint {data.get('fingerprint')!r}")
    results = data.get("results")
    if not isinstance(results, dict):
        raise ValueError("'results' is not an object")
    out: _Entries = {}
    for key, entry in results.items():
        if not isinstance(entry, dict):
            raise ValueError(f"entry {key!r} is not an object")
        at = entry.get("at")
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError(f"entry {key!r} has no valid time: {at!r}")
        seen = entry.get("seen", 1)  # written before "seen" existed: one sighting
        if isinstance(seen, bool) or not isinstance(seen, int) or seen < 1:
            raise ValueError(f"entry {key!r} has no valid 'seen' count: {seen!r}")
        result_data: Any = entry.get("result")
        try:
            result = ProbeResult.from_dict(result_data)
        except ValueError as exc:
            raise ValueError(f"entry {key!r}: {exc}") from exc
        if result.candidate != key:
            raise ValueError(f"entry {key!r} holds the result of {result.candidate!r}")
        out[key] = CachedResult(result, float(at), seen)
    return out
