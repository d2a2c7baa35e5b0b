"""The one place that reads ``os.environ``.

Precedence everywhere in this library: an explicit argument > the user's environment > our
default. Decision code takes ``env: Mapping[str, str]``; only entry points call `snapshot`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager


def snapshot(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment to decide on (``env`` when given, else ``os.environ``)."""
    return dict(os.environ if env is None else env)


def apply(
    variables: Mapping[str, str], target: MutableMapping[str, str] | None = None
) -> dict[str, str]:
    """Set ``variables`` in ``target`` (default ``os.environ``) where it has none of them yet;
    return what was set. A variable already there (the user's) is never overwritten."""
    into: MutableMapping[str, str] = os.environ if target is None else target
    applied: dict[str, str] = {}
    for name, value in variables.items():
        if name in into:
            continue
        into[name] = value
        applied[name] = value
    return applied


@contextmanager
def setting(variables: Mapping[str, str],
            target: MutableMapping[str, str] | None = None) -> Iterator[dict[str, str]]:
    """Within the block, ``variables`` set in ``target`` (default ``os.environ``) where it has
    none of them yet (`apply`: the user's stand); after it, what was set is removed again.
    Yields what was set (the processes started inside inherit it)."""
    into: MutableMapping[str, str] = os.environ if target is None else target
    applied = apply(variables, into)
    try:
        yield applied
    finally:
        for name in applied:
            into.pop(name, None)


def unset_added(names: Iterable[str], before: Mapping[str, str],
                target: MutableMapping[str, str] | None = None) -> None:
    """Remove each of ``names`` that ``before`` (a `snapshot` taken earlier) did not hold, from
    ``target`` (default ``os.environ``): a variable a library set on our behalf (torchrun's
    ``OMP_NUM_THREADS``) goes; one the user set stays."""
    into: MutableMapping[str, str] = os.environ if target is None else target
    for name in names:
        if name not in before:
            into.pop(name, None)
