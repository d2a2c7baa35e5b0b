"""One decision per node under a launcher: local rank 0 publishes, the others wait for it.

The rendezvous is a JSON file named for this launch (the launcher's process id, which every local
rank shares as its parent, plus TORCHELASTIC_RUN_ID and MASTER_PORT) and the machine fingerprint,
written atomically. No framework is imported and no port is opened: the decision must be made
before torch initializes anything.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import ResilientStrategyError


class AgreementTimeoutError(ResilientStrategyError):
    """Local rank 0 did not publish a decision in time."""


@dataclass(frozen=True)
class Agreement:
    path: Path

    @classmethod
    def for_job(cls, env: Mapping[str, str], fingerprint: str, directory: Path | None) -> Agreement:
        run = env.get("TORCHELASTIC_RUN_ID", "none")
        port = env.get("MASTER_PORT", "0")
        base = directory or Path(tempfile.gettempdir()) / "resilient_strategy"
        name = f"agree-{os.getppid()}-{run}-{port}-{fingerprint}.json"
        return cls(base / name)

    def publish(self, payload: Mapping[str, Any]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=self.path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                json.dump({**payload, "published_at": time.time()}, fh)
            os.replace(tmp, self.path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise ResilientStrategyError(
                f"cannot publish the decision for the other ranks at {self.path}: {exc}; set "
                "RESILIENT_STRATEGY_CACHE_DIR to a writable directory"
            ) from exc

    def wait(self, timeout_s: float, poll_s: float = 0.1) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                data: dict[str, Any] = json.loads(self.path.read_text(encoding="utf-8"))
                return data
            except (FileNotFoundError, ValueError):
                pass
            if time.monotonic() >= deadline:
                raise AgreementTimeoutError(
                    f"local rank 0 published no decision within {timeout_s:g} s ({self.path}); "
                    "it may have crashed: see its log"
                )
            time.sleep(poll_s)
