"""resilient_strategy: prove which distributed strategy works here, fall back when NCCL breaks.

    import resilient_strategy                      # imports no framework; watches for them
    sel = resilient_strategy.resilient_strategy(framework="tensorflow", global_batch_size=256)
    with sel.scope():
        model = build_model()

Importing this package does no GPU work and imports no framework (PEP 562 lazy attributes). It
starts a cheap import watch so that a later error can name the file and line that imported a
framework too early.
"""

from __future__ import annotations

from .machine.guard import install_import_watch

TYPE_CHECKING = False  # not typing.TYPE_CHECKING: importing typing costs ~8 ms (mypy knows both)

__version__ = "0.4.0"
__all__ = [
    "CacheError",
    "ExtraNotInstalledError",
    "Facts",
    "FrameworkInitializedError",
    "FrameworkNotInstalledError",
    "GpuUnusableError",
    "InvalidOptionError",
    "InvalidRuleError",
    "InvalidVisibleDevicesError",
    "MultiNodeError",
    "NoWorkingStrategyError",
    "NodeLostError",
    "NodeMismatchError",
    "ResilientStrategyError",
    "Rule",
    "Selection",
    "WrongFrameworkError",
    "__version__",
    "detect_facts",
    "resilient_strategy",
]

install_import_watch()

_LAZY = {
    "resilient_strategy": ("deciding.executor", "resilient_strategy"),
    "Selection": ("selection", "Selection"),
    "Facts": ("core.values.facts", "Facts"),
    "Rule": ("core.knowledge.rules", "Rule"),
    "detect_facts": ("machine.inspect", "detect_facts"),
    "ResilientStrategyError": ("errors", "ResilientStrategyError"),
    "InvalidVisibleDevicesError": ("errors", "InvalidVisibleDevicesError"),
    "FrameworkInitializedError": ("errors", "FrameworkInitializedError"),
    "FrameworkNotInstalledError": ("errors", "FrameworkNotInstalledError"),
    "GpuUnusableError": ("errors", "GpuUnusableError"),
    "InvalidOptionError": ("errors", "InvalidOptionError"),
    "InvalidRuleError": ("errors", "InvalidRuleError"),
    "NoWorkingStrategyError": ("errors", "NoWorkingStrategyError"),
    "CacheError": ("errors", "CacheError"),
    "MultiNodeError": ("errors", "MultiNodeError"),
    "NodeLostError": ("errors", "NodeLostError"),
    "NodeMismatchError": ("errors", "NodeMismatchError"),
    "ExtraNotInstalledError": ("errors", "ExtraNotInstalledError"),
    "WrongFrameworkError": ("errors", "WrongFrameworkError"),
}

if TYPE_CHECKING:
    from typing import Any

    from .core.knowledge.rules import Rule
    from .core.values.facts import Facts
    from .deciding.executor import resilient_strategy
    from .errors import (
        CacheError,
        ExtraNotInstalledError,
        FrameworkInitializedError,
        FrameworkNotInstalledError,
        GpuUnusableError,
        InvalidOptionError,
        InvalidRuleError,
        InvalidVisibleDevicesError,
        MultiNodeError,
        NodeLostError,
        NodeMismatchError,
        NoWorkingStrategyError,
        ResilientStrategyError,
        WrongFrameworkError,
    )
    from .machine.inspect import detect_facts
    from .selection import Selection


def __getattr__(name: str) -> Any:
    try:
        module, attr = _LAZY[name]
    except KeyError:
        raise AttributeError(f"module 'resilient_strategy' has no attribute {name!r}") from None
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), attr)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
