"""A fake of the job's store (check / get / set / add, as torch's TCPStore) and a settable clock,
for the supervisors' peer watch and membership round tested without processes."""

from __future__ import annotations

import threading


class FakeStore:
    """``up`` False: every call fails as a store behind a link that is down does."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.up = True
        self._lock = threading.Lock()

    def _reach(self) -> None:
        if not self.up:
            raise RuntimeError("Socket Timeout")

    def check(self, keys: list[str]) -> bool:
        self._reach()
        return all(k in self.data for k in keys)

    def get(self, key: str) -> bytes:
        self._reach()
        return self.data[key]

    def set(self, key: str, value: str | bytes) -> None:
        self._reach()
        self.data[key] = value.encode() if isinstance(value, str) else value

    def add(self, key: str, n: int) -> int:
        self._reach()
        with self._lock:
            v = int(self.data.get(key, b"0")) + n
            self.data[key] = str(v).encode()
            return v


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t
