"""Numbers as people read them: sizes and durations for traces and messages."""

from __future__ import annotations


def human_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def human_duration(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds * 1e9:.3g} ns"


def fit(text: str, limit: int) -> str:
    """``text`` on one line (runs of whitespace made one space), cut to ``limit`` characters
    with "..." where it was longer: for the short lines a decision or a fault prints."""
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: max(0, limit - 3)].rstrip() + "..."
