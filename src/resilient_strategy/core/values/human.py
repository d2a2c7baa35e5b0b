"""Numbers as people read them: sizes and durations for traces and messages."""

from __future__ import annotations

import re
from collections.abc import Sequence


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


#: Where a clause may end: a top-level comma, semicolon, colon, full stop or dash, and the
#: start of a parenthesis (what a shortened part keeps is its leading whole clauses).
_CLAUSE_ENDS = (", ", "; ", ": ", ". ", " - ", " (")

Part = str | tuple[int, str]


def _leads(text: str, sentence: bool) -> list[str]:
    """``text``'s leading whole clauses, shortest first, then ``text`` itself. Pure."""
    out: list[str] = []
    depth = 0
    for i, ch in enumerate(text):
        # "ranks 0, 1" and "1,024" are one phrase: a comma before a digit ends no clause
        if depth == 0 and i > 0 and text.startswith(_CLAUSE_ENDS, i) and not (
                ch == "," and text[i + 2:i + 3].isdigit()):
            lead = text[:i].rstrip(" ,;:-(")
            if lead and (not out or lead != out[-1]):
                out.append(lead + "." if sentence and not lead.endswith((".", "!", "?"))
                           else lead)
        depth += {"(": 1, ")": -1}.get(ch, 0)
        depth = max(depth, 0)
    out.append(text)
    return out


def _words(text: str, room: int) -> str:
    """``text``'s leading whole words within ``room`` characters (at least its first word,
    whole: a word is never cut). Pure."""
    words = text.split(" ")
    kept = words[0]
    for w in words[1:]:
        if len(kept) + 1 + len(w) > room:
            break
        kept += " " + w
    return kept.rstrip(" ,;:-(")


def compose(parts: Sequence[Part], limit: int, *, head: str = "", sep: str = "; ",
            tail: str = "", more: str = "", sentences: bool = False, keep: int = 1) -> str:
    """One line of at most ``limit`` characters, written from whole parts, never cut mid-word.

    ``head`` (always there) + the ``parts`` that fit, in their order, joined by ``sep`` +
    ``more`` (only when a part was left out or shortened: where the rest is, such as
    " (sel.explain(verbose=True))") + ``tail`` (always there: a path, a pointer). A part is a
    text, or ``(importance, text)``: 0 is kept first (a plain text's importance is its
    position). The ``keep`` most important parts first get room at their shortest whole form
    (their first clause); then every part, by importance, takes its longest whole form that
    fits (its leading clauses, or all of it); a part with no form that fits is left out. Only where not even
    ``head`` fits is it shortened, to its leading clauses or whole words (a word longer than
    the line stays whole). ``sentences``: the parts are sentences; a shortened one ends with a
    full stop. Runs of whitespace become one space. Pure: the one way this package writes a
    short line (summary, fallback warning, advice, verdict and fault lines)."""
    items = []
    for i, part in enumerate(parts):
        importance, text = (i, part) if isinstance(part, str) else part
        text = " ".join(text.split())
        if text:
            items.append((importance, i, text))
    head, tail = re.sub(r"\s+", " ", head), re.sub(r"\s+", " ", tail)

    def line(chosen: dict[int, str], shortened: bool) -> str:
        body = sep.join(chosen[i] for i in sorted(chosen))
        start = head if body else head.rstrip(" :;,")
        return start + body + (more if shortened else "") + tail

    whole = {i: t for _, i, t in items}
    if len(line(whole, False)) <= limit:
        return line(whole, False)
    forms = {i: _leads(t, sentences) for _, i, t in items}
    ranked = sorted(items)
    chosen: dict[int, str] = {}
    for _, i, _t in ranked[:keep]:  # the first `keep` parts: room at their shortest first
        if len(line({**chosen, i: forms[i][0]}, True)) <= limit:
            chosen[i] = forms[i][0]
    for place, (_, i, _t) in enumerate(ranked):  # then each, by importance, as long as fits
        if i in chosen or place >= keep:
            fitting = [f for f in forms[i] if len(line({**chosen, i: f}, True)) <= limit]
            if fitting:
                chosen[i] = fitting[-1]
    if chosen:
        return line(chosen, True)
    if items:  # the most important part has no clause short enough: its leading whole words
        _, first, text = min(items)
        room = limit - len(head) - len(more) - len(tail)
        if room >= len(text.split(" ")[0]):
            return line({first: _words(text, room)}, True)
    # not even the head fits: its leading clauses, else its leading whole words
    bare = head.rstrip(" :;,")
    room = max(1, limit - len(more) - len(tail))
    short = next((f for f in reversed(_leads(bare, False)) if len(f) <= room), "")
    return (short or _words(bare, room)) + more + tail


def fit(text: str, limit: int, *, more: str = "") -> str:
    """``text`` on one line (runs of whitespace made one space), at most ``limit``
    characters: all of it, or its leading whole clauses (whole words where no clause is short
    enough), then ``more`` (where the rest is). Never cut mid-word (`compose`)."""
    return compose((text,), limit, more=more)


_SOURCE = re.compile(r"\s*\(source: [^()]*\)\s*$")
_ID = re.compile(r"^\[[a-z0-9_.-]+\]\s")
_SENTENCE_START = re.compile(r"[A-Z`'\"(\[]")


def _sentences(text: str) -> list[str]:
    """``text`` split after each full stop (or ! ?) outside parentheses that a capital or a
    quote follows ("... EADDRINUSE" inside a quoted message stays whole). Pure."""
    out: list[str] = []
    depth = start = 0
    for i, ch in enumerate(text):
        depth = max(0, depth + {"(": 1, ")": -1}.get(ch, 0))
        if (depth == 0 and ch in ".!?" and text[i + 1:i + 2] == " "
                and _SENTENCE_START.match(text, i + 2) and text[i - 1:i] != "."):
            out.append(text[start:i + 1].strip())
            start = i + 2
    out.append(text[start:].strip())
    return [s for s in out if s]


def brief(text: str, limit: int, *, head: str = "", more: str = "") -> str:
    """Advice (a rule's message, a note) in one line of at most ``limit`` characters: its
    ``[id]``, its last sentence (what to do) and its first (what it is about) first, the
    sentences between where they fit, each shortened to whole clauses where needed; its
    ``(source: ...)`` left to the full text; ``more`` says where that is. Pure (`compose`)."""
    text = _SOURCE.sub("", " ".join(text.split()))
    m = _ID.match(text)
    if m:
        head, text = head + m.group(0), text[m.end():]
    sentences = _sentences(text)
    n = len(sentences)
    # what to do first (it grows first), then what it is about, then the sentences between
    ranked = [(0 if i == n - 1 else 1 if i == 0 else i + 1, s) for i, s in enumerate(sentences)]
    return compose(ranked, limit, head=head, sep=" ", more=more, sentences=True, keep=2)
