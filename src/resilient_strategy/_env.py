"""The one place that reads ``os.environ``.

Precedence everywhere in this library: an explicit argument > the user's environment > our
default. Decision code takes ``env: Mapping[str, str]``; only entry points call :func:`snapshot`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping


def snapshot(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of the environment to decide on (``env`` when given, else ``os.environ``)."""
    return dict(os.environ if env is None else env)


def apply(variables: Mapping[str, str], env: Mapping[str, str] | None = None) -> dict[str, str]:
    """Set ``variables`` in ``os.environ`` where the user has not set them; return what was set.

    A variable the user set (present in ``env``, default ``os.environ``) is never overwritten.
    """
    current = os.environ if env is None else env
    applied: dict[str, str] = {}
    for name, value in variables.items():
        if name in current:
            continue
        os.environ[name] = value
        applied[name] = value
    return applied
