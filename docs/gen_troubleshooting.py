"""Generate docs/troubleshooting.md from the data the tool decides with, so it cannot drift.

Sources, each read when it exists:

- ``core/knowledge/causes.py`` ``CAUSES``: every cause a probe (or a mid-run failure) can be given;
- the planner's remedies per cause (``core/planning/plan.py``), and ``core/knowledge/remedies.toml``;
- ``core/knowledge/signatures.toml``: failure texts and the cause they mean;
- ``core/knowledge/known_issues.toml``: the rules that veto, prefer, remedy, set or warn from the facts;
- ``core/knowledge/node_differences.toml``: the differences between a multi-node job's nodes that matter.

Run as a MkDocs hook (``hooks:`` in mkdocs.yml: the page is rendered at build time), or by hand,
``python docs/gen_troubleshooting.py`` (rewrites the committed page). ``tests/test_docs.py``
checks that the committed page is what this renders.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "src" / "resilient_strategy" / "core" / "knowledge"
PAGE = ROOT / "docs" / "troubleshooting.md"
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

_EFFECT = {
    "veto": "rules the candidate(s) out before any probe",
    "prefer": "tries the candidate(s) first",
    "remedy": "probes the candidate again with these variables set",
    "set_env": "sets these variables for the chosen strategy",
    "warn": "warns (in the trace and the log); decides nothing",
    "no_gpu": "plans without the GPUs, before any probe (no GPU can run this build)",
}
_OUTCOME = ("The candidate that failed is ruled out for this decision and the next one in the "
            "ranking is probed (or the fastest one left is chosen); the same global batch is kept. "
            "A probe's failure is cached for this machine (not one of the last-resort one "
            "device or CPU, of a rehearsal, or of a cause of the machine's state) and trusted "
            "from the cache once it was seen in two runs in a row.")


def _toml(name: str, core: Path = CORE) -> dict[str, Any]:
    path = core / name
    if not path.is_file():
        return {}
    with path.open("rb") as f:
        return tomllib.load(f)


def _entries(data: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """Every table of arrays (``[[signature]]``, ``[[remedy]]``, ...) as (kind, entry)."""
    out: list[tuple[str, dict[str, Any]]] = []
    for kind, value in data.items():
        if isinstance(value, list):
            out += [(kind, e) for e in value if isinstance(e, dict)]
        elif isinstance(value, dict):  # [cause.x] tables
            out += [(kind, {"id": k, **v}) for k, v in value.items() if isinstance(v, dict)]
    return out


def _name(entry: Mapping[str, Any]) -> str:
    for key in ("id", "cause", "name", "key"):
        if isinstance(entry.get(key), str):
            return str(entry[key])
    return "entry"


#: The values a rule's message or a remedy's variable shows for the example machine of this page,
#: where the tool puts the machine's own (``{driver.version}``: `fill_message`): a driver too
#: old for a CUDA 12 build, a torch bundling an NCCL older than Hopper's, two RDMA devices...
EXAMPLE: dict[str, Any] = {
    "driver.version": "470.256.02", "driver.cuda": "11.4", "torch.nccl": "2.14.3",
    "torch.version": "2.13.0+rocm6.4", "torch.hip": "6.4", "host.amd_gpus": 8,
    "host.cuda_compat": "12.8", "host.port_range": "32768-60999", "env.MASTER_PORT": "41163",
    "env.GLOO_SOCKET_IFNAME": "^docker0,lo", "platform.fabric_manager": "470.239.06",
    "platform.rdma_devices": ("mlx5_0", "mlx5_1"), "gpus.nvlinks_outside": 12,
}


def _shown(value: Any) -> str:
    return ",".join(value) if isinstance(value, tuple) else str(value)


def _filled(text: str) -> str:
    """``text`` as the tool prints it on the example machine (`EXAMPLE`)."""
    from resilient_strategy.core.knowledge.clauses import fill_message

    return fill_message(text, EXAMPLE)


def _value(v: Any) -> str:
    if isinstance(v, str):
        return _filled(v.replace("\n", " ").strip())
    if isinstance(v, Mapping):
        return ", ".join(f"`{k}={_filled(str(x))}`" for k, x in v.items())
    if isinstance(v, Sequence):
        return ", ".join(_value(x) if isinstance(x, Mapping) else f"`{x}`" for x in v)
    return f"`{v}`"


_URL = re.compile(r"https?://[^\s;,)>]+[^\s;,)>.]")


_LITERAL_KEYS = ("pattern", "patterns", "regex", "match", "text", "contains")


def _code(value: Any) -> str:
    """A literal (a pattern, a log text) as a code span, whatever backticks it holds."""
    if isinstance(value, list):
        return ", ".join(_code(v) for v in value)
    text = str(value).replace("\n", " ")
    fence = "``" if "`" in text else "`"
    return f"{fence} {text} {fence}" if fence == "``" else f"`{text}`"


def _source(text: str) -> str:
    """A source with its addresses as links (a trailing ';', ',', ')' or '.' stays text)."""
    return _URL.sub(lambda m: f"<{m.group(0)}>", text)


def _generic(kind: str, entry: Mapping[str, Any], skip: Sequence[str] = ()) -> list[str]:
    lines = [f"#### `{_name(entry)}`", ""]
    for key, value in entry.items():
        if key in ("id", *skip):
            continue
        shown = _source(_value(value)) if key == "source" else _code(value) \
            if key in _LITERAL_KEYS else _value(value)
        lines.append(f"- **{key}**: {shown}")
    return [*lines, ""]


def _env(remedy: Mapping[str, str]) -> str:
    return " ".join(f"`{k}={_filled(str(v))}`" for k, v in remedy.items())


def _remedy_words(r: Mapping[str, Any]) -> str:
    """One remedy: its variables, where it applies (backends, facts), and its id."""
    words = _env(r.get("env", {}))
    backends = r.get("backends")
    if backends and list(backends) != ["nccl"]:
        words += f" (for {', '.join(backends)})"
    if r.get("when"):
        words += " when " + " and ".join(f"`{c}`" for c in r["when"])
    return words + f" [`{r.get('id', '?')}`]"


#: What the decision does instead for each cause that is no verdict (`NO_VERDICT_CAUSES`).
_NO_VERDICT = {
    "no_space": "the decision stops with a `NoSpaceError` naming the temp directory "
    "(under `resilient-strategy run`: one line, exit 75)",
    "status_lost": "the candidate is probed once more, its workers started as fresh interpreters "
    "(a second lost status rules it out for this run only)",
}


def _causes(sigs: list[tuple[str, dict[str, Any]]], remedy_data: Mapping[str, Any]
            ) -> list[str]:
    from resilient_strategy.core.knowledge.causes import CAUSES
    from resilient_strategy.core.planning import plan as _plan

    environmental: frozenset[str] = frozenset()
    with contextlib.suppress(ImportError):
        from resilient_strategy.core.knowledge.causes import ENVIRONMENTAL_CAUSES as environmental
    no_verdict: frozenset[str] = frozenset()
    with contextlib.suppress(ImportError):
        from resilient_strategy.core.knowledge.causes import NO_VERDICT_CAUSES as no_verdict
    by_id = {str(r.get("id")): r for r in remedy_data.get("remedy", []) if isinstance(r, dict)}
    order: Mapping[str, Sequence[str]] = remedy_data.get("causes", {})
    # before the remedy table existed, the planner held the remedies per cause in code
    in_code: Mapping[str, Sequence[Mapping[str, str]]] = getattr(_plan, "_REMEDY_FOR_CAUSE", {})
    lines = ["## Causes a probe or a training run can be given", "",
             "Each failed probe, and each mid-run failure under `resilient-strategy run`, has "
             "one of these causes (`ProbeResult.cause`, `FailureCause.cause`, `--json` "
             "`probes.*.cause`). " + _OUTCOME, ""]
    for cause, meaning in CAUSES.items():
        if not cause:
            continue
        lines += [f"### `{cause}`", "", f"**What it means**: {meaning}.", ""]
        tried = [_remedy_words(by_id[i]) for i in order.get(cause, ()) if i in by_id] \
            or [_env(r) for r in in_code.get(cause, ())]
        first = [by_id[i] for i in order.get(cause, ()) if i in by_id][:1]
        if tried:
            lines.append("**What it does about it**: probes these remedies in turn, each where "
                         "its facts hold and never over a variable you set: "
                         + "; then ".join(tried) + ".")
        elif cause in no_verdict:
            lines.append("**What it does about it**: no verdict on the candidate by itself, "
                         "never a fallback on its account: "
                         + _NO_VERDICT.get(cause, "the candidate is probed once more") + ".")
        else:
            lines.append("**What it does about it**: moves on to the next candidate.")
        if cause in environmental:
            lines.append(" It is never cached: a cause of the machine's state, not of the "
                         "backend.")
        lines.append("")
        lines.append("**What you can do**: " + (
            f"when {_env(first[0].get('env', {}))} is what made it work here, set it yourself on "
            "machines like this one: they skip the failing probe (the cache remembers it for "
            "this machine only). " if first else "")
            + "The failing rank's own words are in the probe's detail (`sel.explain()`, "
            "`python -m resilient_strategy probe --json`: `probes.*.detail` and `stderr_tail`); "
            "once fixed, `probe --force` proves the candidate again.")
        lines.append("")
        for _, e in sigs:
            if e.get("cause") != cause:
                continue
            literal = f"exit signal {e['signal']}" if "signal" in e \
                else _code(next((e[k] for k in _LITERAL_KEYS if k in e), _name(e)))
            lines.append(f"- Recognised from ({e.get('kind', 'text')}, `{_name(e)}`): {literal}"
                         + (f" ({_source(str(e['source']))})" if e.get("source") else ""))
        if lines[-1] != "":
            lines.append("")
    return lines


def _rules(data: Mapping[str, Any]) -> list[str]:
    lines = ["## Known issues (rules from the machine's facts)", "",
             "Rules fire from what inspection reads, before any probe "
             "(`core/knowledge/known_issues.toml`; add yours with `rules=` or `RESILIENT_STRATEGY_RULES`, "
             "switch one off with `disable_rules=` or `RESILIENT_STRATEGY_DISABLE_RULES`). "
             "A rule that fired is named in `sel.explain()` and in `to_dict()['rules_fired']`.", ""]
    for rule in data.get("rule", []):
        effect = str(rule.get("effect", ""))
        lines += [f"### `{rule.get('id', '?')}`", ""]
        lines.append(f"**When** ({rule.get('framework', 'any framework')}): "
                     + " and ".join(f"`{c}`" for c in rule.get("when", [])) + ".")
        lines.append("")
        lines.append(f"**What it means**: {_value(rule.get('message', ''))}")
        lines.append("")
        what = _EFFECT.get(effect, effect)
        if rule.get("target"):
            what += f": {_value(rule['target'] if isinstance(rule['target'], list) else [rule['target']])}"
        if rule.get("env"):
            what += f": {_value(rule['env'])}"
        lines += [f"**What it does**: {what}.", "",
                  f"**Source**: {_source(_value(rule.get('source', '')))}", ""]
    return lines


_NODE_EFFECT = {
    "warn": "warns (in the trace, `doctor` and the log); decides nothing",
    "rule_out": "rules NCCL between the nodes out before any probe (node 0's own NCCL and gloo "
                "between the nodes stay)",
}
_NODE_KIND = {"differs": "the nodes report different values of", "shared": "two or more nodes "
              "report the same", "any": "some node reports"}


def _node_differences(data: Mapping[str, Any]) -> list[str]:
    entries = data.get("difference", [])
    if not entries:
        return []
    lines = ["## Differences between the nodes (multi-node jobs)", "",
             "Every node sends its facts through the job's store; node 0 compares them before "
             "any probe (`core/node_differences.toml`). A difference that matters is a "
             "`nodes_differ` event in the trace naming the nodes and their values, and is listed "
             "by `doctor`.", ""]
    for e in entries:
        fact = str(e.get("fact", "?"))
        if e.get("variables"):
            fact += " (" + ", ".join(f"`{v}`" for v in e["variables"]) + ")"
        what = _NODE_EFFECT.get(str(e.get("effect", "warn")), str(e.get("effect")))
        if e.get("keep_env"):
            what += f", except NCCL with {_value(e['keep_env'])}"
        lines += [f"### `{e.get('id', '?')}`", "",
                  f"**When** {_NODE_KIND.get(str(e.get('kind', 'differs')), '?')} {fact}.", "",
                  f"**What it means**: {_value(e.get('message', ''))}", "",
                  f"**What it does**: {what}.", "",
                  f"**Source**: {_source(_value(e.get('source', '')))}", ""]
    return lines


def render(core: Path = CORE) -> str:
    """The page, from the data files in ``core`` (the package's ``core/knowledge/`` folder)."""
    sigs = _entries(_toml("signatures.toml", core))
    remedy_data = _toml("remedies.toml", core)
    remedies = _entries({"remedy": remedy_data.get("remedy", [])})
    lines = ["# Troubleshooting: every cause the tool can name", "",
             "<!-- Generated by docs/gen_troubleshooting.py from the tool's own data; do not edit "
             "by hand. -->", "",
             "When a probe fails, `resilient_strategy` names a cause, says it in the FALLBACK "
             "warning and in `sel.explain()`, and acts on it. This page lists every cause, what "
             "it does about it, and every known-issue rule. What you can do is in each entry's "
             "words; [Reading a decision trace](how-to/decision-trace.md) shows where to find "
             "them for your run. Where a message or a variable names a value of the machine "
             "(a version, a device), it is shown for an example machine: "
             + ", ".join(f"`{k}` {_shown(v)}" for k, v in EXAMPLE.items()) + ".", ""]
    lines += _causes(sigs, remedy_data)
    from resilient_strategy.core.knowledge.causes import CAUSES

    blame = [(k, e) for k, e in sigs if k in ("distributed_frame", "script_fault")]
    stray = [(k, e) for k, e in sigs if e.get("cause") not in CAUSES and (k, e) not in blame]
    lines += _rules(_toml("known_issues.toml", core))
    lines += _node_differences(_toml("node_differences.toml", core))
    for title, entries in (("Remedies", remedies), ("Other failure signatures", stray),
                           ("Whose fault a rank's exception is (resilient-strategy run)",
                            blame)):
        if entries:
            lines += [f"## {title}", ""]
            for kind, e in entries:
                lines += _generic(kind, e)
    return "\n".join(lines).rstrip() + "\n"


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """MkDocs hook: the troubleshooting page is rendered from the data at build time."""
    return render() if page.file.src_uri == "troubleshooting.md" else markdown


if __name__ == "__main__":
    PAGE.write_text(render(), encoding="utf-8")
    print(f"wrote {PAGE}")
