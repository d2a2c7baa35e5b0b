"""The data files the package ships: one list, read through `importlib.resources`.

Every table the engine reads at run time (``known_issues.toml``, ``signatures.toml``,
``remedies.toml``) is named in `DATA_FILES` and read with `read_data`, so an installed wheel
reads the same bytes a source checkout does (the wheel's package data is ``core/*.toml``;
``tests/test_package.py`` builds the wheel and checks that every name here is in it).
"""

from __future__ import annotations

from importlib import resources

from ..errors import MissingDataFileError

DATA_FILES: tuple[str, ...] = ("known_issues.toml", "signatures.toml", "remedies.toml",
                               "node_differences.toml", "nccl_diagnostics.toml")


def read_data(name: str) -> tuple[str, str]:
    """The text of a shipped data file and where it was read from (for error messages)."""
    if name not in DATA_FILES:
        raise ValueError(f"{name!r} is not one of the shipped data files {DATA_FILES}")
    entry = resources.files(__package__ or "resilient_strategy.core").joinpath(name)
    try:
        return entry.read_text(encoding="utf-8"), str(entry)
    except FileNotFoundError:
        raise MissingDataFileError(
            f"the installed resilient_strategy has no {name} (at {entry}); reinstall it "
            "from a wheel built with its package data") from None
