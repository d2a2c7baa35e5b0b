"""The one place that reads ``os.environ``.

Precedence everywhere in this library: an explicit argument > the user's environment > our
default. Decision code takes ``env: Mapping[str, str]``; only entry points call `snapshot`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping


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
