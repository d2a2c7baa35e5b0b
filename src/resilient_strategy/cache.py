"""The decision cache: probe results per machine fingerprint, as JSON, written atomically.

The decision itself is not stored: the planner is pure and fast, so a cached run re-plans from
the cached results and reaches the same choice in milliseconds without probing. A changed
fingerprint (GPUs, driver, framework or NCCL version, relevant environment) is a different file,
so it re-probes. A corrupt or unreadable file is set aside and probing runs again; an unwritable
directory is a logged degrade. Nothing here raises to the user.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .probe import ProbeResult

log = logging.getLogger("resilient_strategy")

FORMAT_VERSION = 1
DEFAULT_TTL_S = 7 * 24 * 3600.0


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
        return self.directory / f"{fingerprint}.json"

    def load(self, fingerprint: str, now: float | None = None) -> dict[str, ProbeResult]:
        """Unexpired results for this fingerprint; {} when none, expired, or unreadable."""
        now = time.time() if now is None else now
        path = self.path(fingerprint)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {}
        except OSError as exc:
            log.warning("resilient_strategy: cannot read cache %s (%s); probing again", path, exc)
            return {}
        try:
            data = json.loads(text)
            if data.get("version") != FORMAT_VERSION or data.get("fingerprint") != fingerprint:
                raise ValueError("written by another version or for another machine")
            out = {}
            for key, entry in data["results"].items():
                if now - float(entry["at"]) <= self.ttl_s:
                    out[key] = ProbeResult.from_dict(entry["result"])
            return out
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            aside = path.with_suffix(".corrupt")
            try:
                os.replace(path, aside)
            except OSError:
                aside = path
            log.warning(
                "resilient_strategy: cache file %s is unreadable (%s); kept as %s, probing again",
                path, exc, aside,
            )
            return {}

    def store(
        self, fingerprint: str, results: Mapping[str, ProbeResult], now: float | None = None
    ) -> bool:
        """Merge these results into the file atomically; False (and a warning) when it can't."""
        now = time.time() if now is None else now
        entries: dict[str, dict[str, object]] = {}
        path = self.path(fingerprint)
        try:
            old = json.loads(path.read_text(encoding="utf-8"))
            if old.get("version") == FORMAT_VERSION and old.get("fingerprint") == fingerprint:
                entries.update(old["results"])
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            pass
        for key, res in results.items():
            entries[key] = {"at": now, "result": res.to_dict()}
        blob = {"version": FORMAT_VERSION, "fingerprint": fingerprint, "results": entries}
        tmp = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=self.directory)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump(blob, fh, indent=1, sort_keys=True)
            os.replace(tmp, path)
            return True
        except OSError as exc:
            log.warning("resilient_strategy: cannot write cache %s (%s); continuing", path, exc)
            if tmp is not None:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
            return False

    def clear(self, fingerprint: str) -> None:
        with contextlib.suppress(OSError):
            self.path(fingerprint).unlink()
