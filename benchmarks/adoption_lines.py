"""How many lines adopting each public script of the suite changed (issue 43 item 5).

    python benchmarks/adoption_lines.py            # the table docs/how-to/adopt-ddp.md quotes
    python benchmarks/adoption_lines.py --json

For each ``tests/public_scripts/<name>/`` (tests/test_public_scripts.py runs them): the lines
of ``adopted.py`` against ``original.py`` (our own script in the shape of a public one), each
after its header (up to the ``# (end of header)`` line). A line replaced counts once, a line
added or removed once (difflib's opcodes: a replaced block counts its longer side). Lines of the
adopted script that end in ``# resume under run`` are what the script adds so that a relaunch
under ``resilient-strategy run`` resumes from its own checkpoint and says so; they are counted
apart (``to resume``) and in ``changed``.
"""

from __future__ import annotations

import argparse
import difflib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = ROOT / "tests" / "public_scripts"
HEADER_END = "# (end of header)"
RESUME_MARK = "# resume under run"


def code(path: Path) -> list[str]:
    """The script's lines after its header."""
    lines = path.read_text().splitlines()
    return lines[lines.index(HEADER_END) + 1:]


def count(original: list[str], adopted: list[str]) -> dict[str, int]:
    """``changed`` (a replaced line once), ``added``, ``removed``, ``to_resume``, ``lines``."""
    changed = added = removed = 0
    matcher = difflib.SequenceMatcher(a=original, b=adopted, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        changed += max(i2 - i1, j2 - j1)
        added += j2 - j1
        removed += i2 - i1
    resume = sum(line.rstrip().endswith(RESUME_MARK) for line in adopted)
    return {"lines": len(original), "changed": changed, "to_resume": resume, "added": added,
            "removed": removed}


def table(suite: Path = SUITE) -> dict[str, dict[str, int]]:
    """name -> its counts, for every script of the suite (sorted by name)."""
    return {d.name: count(code(d / "original.py"), code(d / "adopted.py"))
            for d in sorted(suite.iterdir()) if (d / "adopted.py").exists()}


def render(rows: dict[str, dict[str, int]]) -> str:
    out = ["| script | original lines | changed | of them, to resume under run | added | removed |",
           "|---|---|---|---|---|---|"]
    out += [f"| {name} | {r['lines']} | {r['changed']} | {r['to_resume']} | {r['added']} | "
            f"{r['removed']} |" for name, r in rows.items()]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    rows = table()
    print(json.dumps(rows, indent=1) if args.json else render(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
