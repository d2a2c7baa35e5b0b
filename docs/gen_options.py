"""Write the options tables of the docs from the option fields (``core/call/fields.py``), so
that an option is described once: ``docs/reference/options.md`` (``resilient_strategy()``'s
keywords) and ``docs/how-to/run.md`` (``resilient-strategy run``'s flags), each between its
``<!-- options:NAME:begin -->`` / ``<!-- options:NAME:end -->`` marks.

Run by hand, ``python docs/gen_options.py`` (rewrites the pages); ``tests/test_options_described_once.py``
fails until the committed pages are what this renders.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from resilient_strategy.core.call.fields import (  # noqa: E402
    CALL_FIELDS,
    RUN_FIELDS,
    OptionField,
    reference_table,
)

#: page -> (the mark's name, the fields its table shows)
PAGES: dict[Path, tuple[str, tuple[OptionField, ...]]] = {
    ROOT / "docs" / "reference" / "options.md": ("call", CALL_FIELDS),
    ROOT / "docs" / "how-to" / "run.md": ("run", RUN_FIELDS),
}
NOTE = "<!-- generated from src/resilient_strategy/core/call/fields.py by python docs/gen_options.py -->\n"


def render(text: str, name: str, fields: tuple[OptionField, ...]) -> str:
    """``text`` with the table between its marks rendered from ``fields``."""
    begin, end = f"<!-- options:{name}:begin -->\n", f"<!-- options:{name}:end -->"
    head, found, rest = text.partition(begin)
    if not found or end not in rest:
        raise ValueError(f"no {begin.strip()} ... {end} in the page")
    return head + begin + NOTE + reference_table(fields) + end + rest.split(end, 1)[1]


def main() -> None:
    for page, (name, fields) in PAGES.items():
        page.write_text(render(page.read_text(encoding="utf-8"), name, fields), encoding="utf-8")


if __name__ == "__main__":
    main()
