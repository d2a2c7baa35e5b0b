"""The decision cache: probe results per machine fingerprint, as JSON, written atomically.

The decision itself is not stored: the planner is pure and fast, so a cached run re-plans from
the cached results and reaches the same choice in milliseconds without probing. A changed
fingerprint (GPUs, driver, framework or NCCL version, relevant environment) is a different file,
so it re-probes. The file name carries the format version too, so two versions of this library
on one machine keep separate files instead of setting each other's aside.

A corrupt or unreadable file (not UTF-8, not JSON, or any entry that is not what :meth:`store`
writes) is set aside as ``.corrupt`` and probing runs again; an unwritable directory is a logged
degrade. Writers take an advisory lock (``<fingerprint>.lock``) around read-merge-replace so that
concurrent processes do not lose each other's results; where locking is not possible they carry
on without it. Nothing here raises to the user.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .probe import ProbeResult

if sys.platform != "win32":
    import fcntl

log = logging.getLogger("resilient_strategy")

FORMAT_VERSION = 1
DEFAULT_TTL_S = 7 * 24 * 3600.0
#: How long a writer waits for another writer's lock before it goes on without one.
LOCK_WAIT_S = 10.0

_Entries = dict[str, tuple[float, ProbeResult]]


def default_dir(env: Mapping[str, str]) -> Path:
    """RESILIENT_STRATEGY_CACHE_DIR > $XDG_CACHE_HOME/resilient_strategy > ~/.cache/..."""
    if env.get("RESILIENT_STRATEGY_CACHE_DIR"):
        return Path(env["RESILIENT_STRATEGY_CACHE_DIR"])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "resilient_strategy"


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
        now = time.time() if now is None else now
        return {
            key: result
            for key, (at, result) in self._read(fingerprint).items()
            if abs(now - at) <= self.ttl_s
        }

    def store(
        self, fingerprint: str, results: Mapping[str, ProbeResult], now: float | None = None
    ) -> bool:
        """Merge these results into the file atomically; False (and a warning) when it can't."""
        now = time.time() if now is None else now
        path = self.path(fingerprint)
        fresh: _Entries = {}
        for key, res in results.items():
            try:
                if ProbeResult.from_dict(res.to_dict()) != res or res.candidate != key:
                    raise ValueError("it does not survive a round trip through JSON")
            except ValueError as exc:
                log.warning("resilient_strategy: not caching the result for %s (%s)", key, exc)
                continue
            fresh[key] = (now, res)
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            with self._locked(fingerprint):
                entries = {k: v for k, v in self._read(fingerprint, locked=True).items()
                           if abs(now - v[0]) <= self.ttl_s}
                entries.update(fresh)
                blob = {
                    "version": FORMAT_VERSION,
                    "fingerprint": fingerprint,
                    "results": {k: {"at": at, "result": r.to_dict()}
                                for k, (at, r) in sorted(entries.items())},
                }
                fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.directory)
                with os.fdopen(fd, "w", encoding="utf-8") as fh:
                    json.dump(blob, fh, indent=1, sort_keys=True, allow_nan=False)
                os.replace(tmp, path)
                tmp = None
            return True
        except (OSError, ValueError) as exc:
            log.warning("resilient_strategy: cannot write cache %s (%s); continuing", path, exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False

    def clear(self, fingerprint: str) -> None:
        with contextlib.suppress(OSError):
            self.path(fingerprint).unlink()

    # ----- internals -------------------------------------------------------------------------
    def _read(self, fingerprint: str, locked: bool = False) -> _Entries:
        """Every valid entry of the file, expired or not; {} when missing or unreadable.

        A file whose contents are not what :meth:`store` writes is set aside, with a warning.
        ``locked``: the caller holds the lock already (flock does not nest across descriptors).
        """
        path = self.path(fingerprint)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("resilient_strategy: cannot read cache %s (%s); probing again", path, exc)
            return {}
        try:
            return _parse(raw, fingerprint)
        except ValueError as exc:
            aside = self._set_aside(fingerprint, raw, locked)
            log.warning(
                "resilient_strategy: cache file %s is unreadable (%s); kept as %s, probing again",
                path, exc, aside,
            )
            return {}

    def _set_aside(self, fingerprint: str, raw: bytes, locked: bool) -> Path:
        """Rename a corrupt file to ``.corrupt`` (unless a writer has replaced it meanwhile)."""
        path = self.path(fingerprint)
        aside = path.with_suffix(".corrupt")
        try:
            with contextlib.nullcontext() if locked else self._locked(fingerprint):
                if path.read_bytes() == raw:
                    os.replace(path, aside)
                    return aside
        except OSError:
            pass
        return path

    @contextlib.contextmanager
    def _locked(self, fingerprint: str) -> Iterator[None]:
        """Hold the fingerprint's advisory lock, best-effort: when the lock file cannot be opened
        or locked (read-only directory, a filesystem without locks, a writer stuck for
        LOCK_WAIT_S), go on without it; the replace is still atomic, only a merge may be lost."""
        fd = None
        if sys.platform != "win32":
            try:
                fd = os.open(self.lock_path(fingerprint), os.O_RDWR | os.O_CREAT, 0o644)
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


def _parse(raw: bytes, fingerprint: str) -> _Entries:
    """The entries of a cache file's bytes. Raises ValueError for anything store() never wrote."""
    data: Any = json.loads(raw.decode("utf-8"))  # UnicodeDecodeError is a ValueError
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
        result_data: Any = entry.get("result")
        try:
            result = ProbeResult.from_dict(result_data)
        except ValueError as exc:
            raise ValueError(f"entry {key!r}: {exc}") from exc
        if result.candidate != key:
            raise ValueError(f"entry {key!r} holds the result of {result.candidate!r}")
        out[key] = (float(at), result)
    return out
