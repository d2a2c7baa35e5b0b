"""The one owner of what this process keeps for its whole life.

Some state is process-wide by nature: a warning said once per process, an exit hook registered
once, a thread NVML never returned from, a store this process hosts for the job, a worker status
another reaper took, the import watch. Each such holder is created by `PROCESS` (`Process.hold`),
named and described there, never as a module's own mutable global: ``PROCESS.holders()`` lists
every one with the module that uses it and what it holds, and
``tests/test_process_state.py`` fails on a module-level mutable value made anywhere else.

A module keeps its own name for its holder (``_warned = PROCESS.hold(...)``), so that its code
and its tests read as before; the value is the owner's. Floor 0: nothing of ours is imported.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

_T = TypeVar("_T")


@dataclass(frozen=True)
class Holder:
    """One process-wide holder: its name (``module.what``), what it holds, and the value."""

    name: str
    what: str
    value: Any = field(compare=False, repr=False)


class Process:
    """This process's holders, by name; one instance, `PROCESS`."""

    def __init__(self) -> None:
        self._holders: dict[str, Holder] = {}

    def hold(self, name: str, make: Callable[[], _T], what: str) -> _T:
        """The holder ``name`` (``package.module.what``), made by ``make`` the first time it is
        asked for; ``what`` says what it holds and why it lives as long as the process."""
        held = self._holders.get(name)
        if held is None:
            held = self._holders[name] = Holder(name, what, make())
        value: _T = held.value
        return value

    def holders(self) -> tuple[Holder, ...]:
        """Every holder made in this process, in the order they were made."""
        return tuple(self._holders.values())


#: The owner of this process's state.
PROCESS = Process()
