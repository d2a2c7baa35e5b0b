"""Messages written short, never cut (issue 47): every short line the package prints (the
summary, the short explain, each warning, the FALLBACK line, a verdict's and a failed attempt's
line) is composed of whole parts (`core.values.human.compose`), rendered here over every
described machine and field case and every cause: no word is cut, no line ends in an
ellipsis, and each line keeps to its length."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_strategy import selection as selection_module
from resilient_strategy.cli import simulate_file
from resilient_strategy.core.knowledge.causes import CAUSES, what_and_fix
from resilient_strategy.core.values.human import brief, compose, fit
from resilient_strategy.deciding import executor, notices
from resilient_strategy.errors import ResilientStrategyError
from resilient_strategy.run import verdicts
from resilient_strategy.run.verdicts import Verdict, VerdictKind, fault_line

ROOT = Path(__file__).parents[1]
CASES = sorted([*(ROOT / "examples" / "machines").rglob("*.json"),
                *(ROOT / "tests" / "fixtures" / "field_heldout").glob("*.json"),
                *(ROOT / "tests" / "fixtures" / "field_training").glob("*.json")])
#: The modules whose templates write the short lines: their literal words are words.
TEMPLATES = " ".join(Path(m.__file__ or "").read_text(encoding="utf-8")
                     for m in (selection_module, notices, executor, verdicts))
_EDGE = "()[]{}'\"`.,;:!?*"


def _norm(token: str) -> str:
    return token.strip(_EDGE)


def _words(*texts: str) -> set[str]:
    return {_norm(t) for text in texts for t in re.split(r"[\s{}]+", text)} - {""}


def _cuts(line: str, words: set[str]) -> list[str]:
    """The tokens of ``line`` that are no whole word of the texts it was written from: a cut
    word, or one that ends in an ellipsis (a standalone "..." quoted from a message is a
    word)."""
    def cut(token: str) -> bool:
        if token not in ("...", "'...", "...'") and (token.endswith("...") or "\u2026" in token):
            return True  # an ellipsis: the old cut
        word = _norm(token)
        return bool(word) and word not in words and not re.fullmatch(r"[\d.,:x/%+-]+", word)

    return [token for token in line.split() if cut(token)]


def test_every_short_line_over_the_machine_cases_is_whole(
        caplog: pytest.LogCaptureFixture) -> None:
    assert len(CASES) > 50
    base = _words(TEMPLATES, *CAUSES.values())
    seen = 0
    for case in CASES:
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="resilient_strategy"):
            try:
                decided = simulate_file(case)
            except ResilientStrategyError:
                continue
        logged = [r.getMessage() for r in caplog.records if r.name == "resilient_strategy"]
        for fw, sel in decided.items():
            if not isinstance(sel, selection_module.Selection):
                continue
            words = base | _words(sel.explain(verbose=True), *sel.plan.warnings,
                                  sel.summary(limit=10**6), *logged)
            lines = [sel.summary(), *sel.explain().splitlines()]
            assert len(lines[0]) <= selection_module.SUMMARY_CHARS, (case.name, lines[0])
            for line in [*lines, *logged]:
                seen += 1
                assert _cuts(line, words) == [], (case.name, fw, line)
        for line in logged:
            limit = (notices.FALLBACK_CHARS if "FALLBACK" in line else executor.WARNING_CHARS)
            assert len(line) <= limit + len("resilient_strategy: "), (case.name, line)
    assert seen > 300


def test_every_verdict_and_fault_line_over_the_causes_is_whole() -> None:
    evidence = "/tmp/rs-run-1/attempt1.txt"
    for cause, words in CAUSES.items():
        if not words:
            continue
        for kind in VerdictKind:
            v = Verdict(kind, f"ranks 0, 1: DistBackendError: {words}", step=12, cause=cause,
                        ranks=(0, 1), where="train.py:42 in step", detail=words)
            known = _words(TEMPLATES, words, v.summary, v.where, evidence)
            for line, limit in ((fault_line(0, "gloo on 2 CPU processes", v, evidence),
                                 verdicts.FAULT_CHARS), (v.line(), 300), (v.line(120), 120)):
                assert _cuts(line, known) == [], (cause, kind, line)
                assert len(line) <= limit, (cause, kind, line)
            assert fault_line(0, "gloo", v, evidence).endswith(f"; evidence: {evidence}")


def test_the_fallback_line_keeps_the_reason_and_the_fix() -> None:
    # with gloo broken on one host: what trains, why (its words), and the fix ("unset it")
    what, fix = what_and_fix("gloo_interface")
    assert fix.endswith("or unset it") and what.startswith("GLOO_SOCKET_IFNAME")
    line = compose([f"its probe failed: {what}", fix, "one CPU process instead of 2", "2 x 1"],
                   notices.FALLBACK_CHARS, head="FALLBACK: CPU instead of gloo on 2 CPU processes: ",
                   tail=notices.FALLBACK_WHY, keep=2)
    assert fix in line and line.endswith(notices.FALLBACK_WHY)


# ----- the composer itself -------------------------------------------------------------------
_TEXT = st.lists(st.text("abcdefgh", min_size=1, max_size=12), min_size=1, max_size=40).map(
    lambda ws: " ".join(w + p for w, p in zip(ws, [", ", ": ", "; ", ". ", " ", " ("] * 9,
                                                 strict=False)))


@settings(max_examples=300, deadline=None)
@given(st.lists(_TEXT, min_size=1, max_size=5), st.integers(min_value=20, max_value=300))
def test_compose_keeps_whole_words_and_its_length(parts: list[str], limit: int) -> None:
    head, more, tail = "head: ", " (more: x)", "; evidence: p"
    line = compose(parts, limit, head=head, more=more, tail=tail)
    words = _words(head, more, tail, *parts)
    assert [t for t in line.split() if _norm(t) and _norm(t) not in words] == []
    assert len(line) <= limit or len(head + more + tail) > limit
    assert line.endswith(tail) and line.startswith("head")


def test_a_whole_text_that_fits_is_left_as_it_is() -> None:
    text = "exited with status 1 without a Python exception"
    assert fit(text, 80) == text
    assert compose(["a", "b"], 80, head="h: ") == "h: a; b"
    assert brief("[id] One. Two (source: https://x)", 80) == "[id] One. Two"
    short = fit(text, 30, more=" (more)")
    assert short.endswith(" (more)") and text.startswith(short.removesuffix(" (more)"))
