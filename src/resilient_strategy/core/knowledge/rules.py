"""Known-issue rules as data: load, validate, and evaluate them against the facts.

A rule (see ``known_issues.toml``) has an ``id``, a list of ``when`` clauses (`clauses`) that must all hold,
an ``effect`` and a ``source``. Clauses read ``<fact> <op> <value>`` over the names that
`fact_values` computes, e.g. ``"tensorflow.version < 2.20"`` or ``"gpus.names matches RTX 50"``;
a bare ``"host.wsl2"`` means true, ``"not host.wsl2"`` false. A fact name that is not in
`FACT_NAMES` (or ``env.<VARIABLE>``) is an error when the rule is loaded; a known fact whose
value is unknown on this machine (torch not installed, /dev/shm unreadable) makes the clause false.

Effects: ``veto`` (rule a backend out), ``prefer`` (try a backend first), ``remedy`` (add an NCCL
variant with ``env``; ``first = true`` tries it before plain NCCL), ``set_env`` (set ``env`` on
every NCCL candidate), ``warn`` (a warning in the trace). Pure: no I/O except `load_rules`.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ...errors import FileFormatError, InvalidOptionError, InvalidRuleError, UnsafePathError
from ...vocab import BACKENDS, FRAMEWORKS
from ..values import bounded
from ..values.facts import Facts
from .candidate_env import refusal
from .clauses import Clause, FactValue, clause_holds, fact_values, fill_message, parse_clause
from .data import read_data

EFFECTS = ("veto", "prefer", "remedy", "set_env", "warn", "no_gpu")

_RULE_KEYS = frozenset(
    {"id", "when", "effect", "message", "source", "target", "framework", "env", "first"}
)
log = logging.getLogger("resilient_strategy")


@dataclass(frozen=True)
class Rule:
    id: str
    when: tuple[Clause, ...]
    effect: str
    message: str
    source: str
    target: tuple[str, ...] = ()  # backends, for veto / prefer
    framework: str = ""  # "" = both
    env: tuple[tuple[str, str], ...] = ()
    first: bool = False  # remedy: try before plain NCCL
    origin: str = "built-in"


def _strings(value: object, key: str, rid: str, origin: str) -> tuple[str, ...]:
    """A TOML string or array of strings as a tuple; anything else is an InvalidRuleError."""
    if isinstance(value, str):
        return (value,)
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise InvalidRuleError(
        rid, f"{key} must be a string or an array of strings, not {value!r}", origin)


def rule_from_dict(d: Mapping[str, Any], origin: str = "built-in", where: str = "?") -> Rule:
    """One rule from its TOML table; ``where`` names it in errors until its id is known."""
    if not isinstance(d, Mapping):
        raise InvalidRuleError(
            where, f"a rule must be a table (written under [[rule]]), not {d!r}", origin)
    raw_id = d.get("id", "")
    rid = raw_id.strip() if isinstance(raw_id, str) else ""
    if not rid:
        raise InvalidRuleError(where, f"every rule needs an id (a non-empty string), not {raw_id!r}",
                               origin)
    extra = set(d) - _RULE_KEYS
    if extra:
        raise InvalidRuleError(
            rid, f"unknown key(s) {sorted(extra)}; allowed: {sorted(_RULE_KEYS)}", origin)
    effect = d.get("effect", "")
    if effect not in EFFECTS:
        raise InvalidRuleError(rid, f"effect must be one of {EFFECTS}, not {effect!r}", origin)
    target = _strings(d.get("target", []), "target", rid, origin)
    if effect in ("veto", "prefer") and (not target or not set(target) <= set(BACKENDS)):
        raise InvalidRuleError(rid, f"{effect} needs target(s) in {BACKENDS}, not {target!r}", origin)
    env = d.get("env", {})
    if not isinstance(env, Mapping) or not all(isinstance(v, str) for v in env.values()):
        raise InvalidRuleError(rid, "env must be a table of strings", origin)
    if effect in ("remedy", "set_env") and not env:
        raise InvalidRuleError(rid, f"{effect} needs env", origin)
    for why in (refusal(str(k), v) for k, v in env.items()):
        if why:  # what a probe worker would refuse to set (candidate_env)
            raise InvalidRuleError(rid, f"env: {why}", origin)
    framework = d.get("framework", "")
    if framework != "" and framework not in FRAMEWORKS:
        raise InvalidRuleError(
            rid, f"framework must be one of {FRAMEWORKS} (or left out), not {framework!r}", origin)
    when = _strings(d.get("when", []), "when", rid, origin)
    message, source = d.get("message"), d.get("source")
    if not (isinstance(message, str) and message.strip()) or not (
        isinstance(source, str) and source.strip()
    ):
        raise InvalidRuleError(rid, "every rule needs a message and a source (strings)", origin)
    first = d.get("first", False)
    if not isinstance(first, bool):
        raise InvalidRuleError(rid, f"first must be true or false, not {first!r}", origin)
    return Rule(
        id=rid,
        when=tuple(parse_clause(c, rid, origin) for c in when),
        effect=effect,
        message=message.strip(),
        source=source.strip(),
        target=target,
        framework=framework,
        env=tuple(sorted((str(k), v) for k, v in env.items())),
        first=first,
        origin=origin,
    )


def parse_rules(text: str, origin: str) -> tuple[Rule, ...]:
    """The rules of one TOML document (``origin`` names it in errors)."""
    try:
        data = bounded.parse_toml(text, origin)
    except FileFormatError as exc:  # not TOML, or nested too deep
        raise InvalidRuleError("?", exc.problem, origin) from None
    unknown = sorted(set(data) - {"rule"})
    if unknown:
        raise InvalidRuleError(
            "?", f"unknown top-level key(s) {unknown}; write each rule as a [[rule]] table", origin)
    tables = data.get("rule", [])
    if not isinstance(tables, list):
        raise InvalidRuleError(
            "?", f"'rule' must be an array of tables (each rule under [[rule]]), not {tables!r}",
            origin,
        )
    rules = tuple(rule_from_dict(r, origin, f"#{n}") for n, r in enumerate(tables, 1))
    ids = [r.id for r in rules]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise InvalidRuleError(dupes[0], "duplicate rule id", origin)
    return rules


def load_rules(
    extra: Iterable[str | Path | Rule] | str | Path | Rule = (),
    disabled: Iterable[str] | str = (),
) -> tuple[Rule, ...]:
    """The built-in rules plus the user's (TOML files or Rule values), minus the disabled ids.

    A user rule with the id of a built-in one replaces it. A bare path (``"mine.toml"``) is one
    file and a bare string in ``disabled`` is one id. Disabling an id that no rule has is logged
    as a warning (it is usually a typo) naming the known ids.
    """
    text, origin = read_data("known_issues.toml")
    rules = {r.id: r for r in parse_rules(text, origin)}
    items = (extra,) if isinstance(extra, (str, Path, Rule)) else tuple(extra)
    for item in items:
        if isinstance(item, Rule):
            rules[item.id] = item
            continue
        if not isinstance(item, (str, Path)):
            raise InvalidOptionError(
                f"rules= takes TOML file paths or Rule values, not {item!r}")
        path = Path(item)
        try:
            text = bounded.read_user_file(path, bounded.MAX_RULES_BYTES).decode()
        except OSError as exc:
            raise InvalidRuleError("?", f"cannot read it: {exc}", str(path)) from exc
        except (UnsafePathError, FileFormatError) as exc:  # a FIFO, a directory, too large
            raise InvalidRuleError("?", f"cannot read it: {exc}", str(path)) from None
        except UnicodeDecodeError as exc:
            raise InvalidRuleError(
                "?", f"not UTF-8 text (TOML files must be UTF-8): {exc}", str(path)) from exc
        for r in parse_rules(text, str(path)):
            rules[r.id] = r
    off = {disabled} if isinstance(disabled, str) else {str(d) for d in disabled}
    unknown = sorted(off - set(rules))
    if unknown:
        log.warning(
            "resilient_strategy: disable_rules names no known rule: %s; known rule ids: %s",
            ", ".join(unknown), ", ".join(sorted(rules)),
        )
    return tuple(r for r in rules.values() if r.id not in off)


def fired(rules: Iterable[Rule], facts: Facts, framework: str,
          replicas: int | None = None, nodes: int | None = None) -> tuple[Rule, ...]:
    """The rules whose clauses all hold for these facts and framework, in order. ``replicas``
    (``plan.replicas``) is the number of devices a multi-device strategy would use: the GPUs
    after ``devices=`` and CUDA_VISIBLE_DEVICES, or the logical CPUs in TF's test mode;
    ``nodes`` (``plan.nodes``) the nodes of the job."""
    values = fact_values(facts, framework, replicas, nodes)
    # in messages, versions as the machine reports them ("535.129.03", not Version's "535.129.3")
    text: dict[str, FactValue] = {**values, "driver.version": facts.driver_version,
                                  "driver.cuda": facts.cuda_driver_version}
    for fw in ("torch", "tensorflow", "keras"):
        info = facts.framework(fw)
        text.update({f"{fw}.version": info.version, f"{fw}.cuda": info.cuda,
                     f"{fw}.nccl": info.nccl, f"{fw}.hip": info.hip})
    return tuple(
        replace(r, message=fill_message(r.message, text)) if "{" in r.message else r
        for r in rules
        if (not r.framework or r.framework == framework)
        and all(clause_holds(c, values) for c in r.when)
    )


