"""Known-issue rules as data: load, validate, and evaluate them against the facts.

A rule (see ``known_issues.toml``) has an ``id``, a list of ``when`` clauses that must all hold,
an ``effect`` and a ``source``. Clauses read ``<fact> <op> <value>`` over the names that
`fact_values` computes, e.g. ``"tensorflow.version < 2.20"`` or ``"gpus.names matches RTX 50"``;
a bare ``"host.wsl2"`` means true, ``"not host.wsl2"`` false. A fact name that is not in
`FACT_NAMES` (or ``env.<VARIABLE>``) is an error when the rule is loaded; a known fact whose
value is unknown on this machine (torch not installed, /dev/shm unreadable) makes the clause false.

Effects: ``veto`` (rule a backend out), ``prefer`` (try a backend first), ``remedy`` (add an NCCL
variant with ``env``; ``first = true`` tries it before plain NCCL), ``set_env`` (set ``env`` on
every NCCL candidate), ``warn`` (a warning in the trace), ``no_gpu`` (the GPUs cannot run this
build at all, a driver too old for it: the chain is planned without them, before any probe,
and the message is the finding with its fix). Pure: no I/O except `load_rules`.
"""

from __future__ import annotations

import difflib
import logging
import operator
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from packaging.version import InvalidVersion, Version

from ..errors import FileFormatError, InvalidOptionError, InvalidRuleError, UnsafePathError
from ..vocab import BACKENDS, FRAMEWORKS
from . import bounded as _bounded
from .data import read_data
from .facts import Facts, Gpu

EFFECTS = ("veto", "prefer", "remedy", "set_env", "warn", "no_gpu")
_OPS = ("<=", ">=", "==", "!=", "<", ">", "matches", "contains", "in")
_CLAUSE = re.compile(
    r"^\s*(?P<neg>not\s+)?(?P<fact>[a-z_]+\.[A-Za-z0-9_]+|framework)"
    r"(?:\s*(?P<op><=|>=|==|!=|<|>)\s*|\s+(?P<wop>matches|contains|in)\s+|$)"
    r"(?P<value>.*?)\s*$"
)

_FRAMEWORK_FACTS = ("installed", "version", "cuda", "nccl", "max_arch", "imported", "gpu_kernels",
                    "build", "hip")
#: Every fact a clause can name (what `fact_values` computes), besides ``env.<VARIABLE>``.
FACT_NAMES: tuple[str, ...] = (
    "framework",
    "gpus.count", "gpus.names", "gpus.min_cc", "gpus.max_cc", "gpus.consumer", "gpus.mig",
    "gpus.mixed", "gpus.numa_nodes",
    "links.all_nvlink", "links.any_pcie_only", "links.p2p_unsupported", "links.cross_socket",
    "links.any_nvlink", "links.any_switch", "links.any_host_path",
    "driver.version", "driver.cuda", "driver.older_than_build", "driver.cuda_major_behind",
    "plan.replicas", "plan.nodes", "nccl.version",
    "platform.nvswitch", "platform.hypervisor", "platform.vm", "platform.rdma_link_layer",
    "platform.rdma_devices", "platform.rdma_count", "platform.master_ifname",
    "platform.hostname_loopback", "platform.fabric_manager", "platform.fabric_manager_mismatch",
    "host.shm_mb", "host.container", "host.in_container", "host.wsl2", "host.sagemaker",
    "host.aws", "host.efa", "host.infiniband", "host.iommu", "host.platform",
    "host.machine", "host.mps", "host.numa_nodes", "host.numa_memory_only", "host.amd_gpus",
    "host.cuda_compat", "host.port_range", "host.master_port_ephemeral",
    *(f"{fw}.{name}" for fw in ("torch", "tensorflow", "keras") for name in _FRAMEWORK_FACTS),
)
_RULE_KEYS = frozenset(
    {"id", "when", "effect", "message", "source", "target", "framework", "env", "first"}
)
log = logging.getLogger("resilient_strategy")

FactValue = str | int | bool | Version | tuple[str, ...] | None
_ORDER_OPS = {
    "<": operator.lt, "<=": operator.le, ">": operator.gt,
    ">=": operator.ge, "==": operator.eq, "!=": operator.ne,
}


@dataclass(frozen=True)
class Clause:
    fact: str
    op: str  # one of _OPS, or "truthy"
    value: str
    negate: bool = False
    #: the compiled regular expression of a ``matches`` clause (compiled when the rule loads)
    pattern: re.Pattern[str] | None = field(default=None, compare=False, repr=False)

    def __str__(self) -> str:
        neg = "not " if self.negate else ""
        return f"{neg}{self.fact}" if self.op == "truthy" else f"{self.fact} {self.op} {self.value}"


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


def parse_clause(text: str, rule_id: str = "?", origin: str = "") -> Clause:
    """Read one ``when`` clause; every problem is an `InvalidRuleError` naming the rule
    (and ``origin``, the file it came from)."""
    m = _CLAUSE.match(text)
    if not m:
        raise InvalidRuleError(
            rule_id, f"cannot read clause {text!r}; expected '<fact> <op> <value>'", origin)
    fact = m.group("fact")
    _check_fact(fact, text, rule_id, origin)
    op = m.group("op") or m.group("wop")
    raw = m.group("value").strip()
    value = raw.strip("'\"")
    if op is None:
        if raw:
            raise InvalidRuleError(rule_id, f"clause {text!r} has a value but no operator", origin)
        op = "truthy"
    elif not raw:
        raise InvalidRuleError(rule_id, f"clause {text!r} has no value after {op!r}", origin)
    pattern = None
    if op == "matches":
        try:
            pattern = re.compile(value, re.IGNORECASE)
        except re.error as exc:
            raise InvalidRuleError(
                rule_id, f"clause {text!r}: {value!r} is not a valid regular expression ({exc})",
                origin,
            ) from exc
    return Clause(fact=fact, op=op, value=value, negate=bool(m.group("neg")), pattern=pattern)


def _check_fact(fact: str, text: str, rule_id: str, origin: str) -> None:
    if fact in FACT_NAMES or (fact.startswith("env.") and len(fact) > len("env.")):
        return
    close = difflib.get_close_matches(fact, FACT_NAMES, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise InvalidRuleError(
        rule_id,
        f"clause {text!r} names unknown fact {fact!r}{hint}; valid facts: "
        f"{', '.join(FACT_NAMES)}, env.<VARIABLE>",
        origin,
    )


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
        data = _bounded.parse_toml(text, origin)
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
            text = _bounded.read_user_file(path, _bounded.MAX_RULES_BYTES).decode()
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


# --------------------------------------------------------------------------------------------
# Facts as named values
# --------------------------------------------------------------------------------------------
def _version(text: str | None) -> Version | None:
    if not text:
        return None
    try:
        return Version(text.split("+")[0])
    except InvalidVersion:
        return None


def _max_arch(archs: Sequence[str]) -> Version | None:
    """Highest compute capability in an arch list like ("sm_89", "compute_90") -> 9.0."""
    best: Version | None = None
    for a in archs:
        m = re.search(r"(\d+)(\d)[a-z]?$", a)
        if m:
            v = Version(f"{m.group(1)}.{m.group(2)}")
            best = v if best is None or v > best else best
    return best


def _kernel_coverage(archs: Sequence[str], gpus: Sequence[Gpu]) -> str | None:
    """"native" when every GPU has SASS of its major with minor <= its own, "ptx_jit" when some
    GPU can run only by JIT-compiling PTX of an older arch, "none" when some GPU has neither;
    None when the arch list is unknown or there are no GPUs."""
    if not archs or not gpus:
        return None
    sass: list[tuple[int, int]] = []
    ptx: list[tuple[int, int]] = []
    for a in archs:
        m = re.fullmatch(r"(sm|compute)_(\d+)(\d)[a-z]?", a.strip())
        if m:
            (sass if m.group(1) == "sm" else ptx).append((int(m.group(2)), int(m.group(3))))
    worst = "native"
    for g in gpus:
        major, minor = g.compute_capability
        if (major, minor) == (0, 0):  # NVML could not read it: no verdict on this GPU
            continue
        if any(s[0] == major and s[1] <= minor for s in sass):
            continue
        if any(p <= (major, minor) for p in ptx):
            worst = "ptx_jit"
            continue
        return "none"
    return worst


def fact_values(facts: Facts, framework: str, replicas: int | None = None,
                nodes: int | None = None) -> dict[str, FactValue]:
    """Every name a rule clause can use, computed from the facts (pure); ``replicas`` and
    ``nodes`` are the planner's ``plan.replicas`` / ``plan.nodes`` (None, unknown, outside a
    plan)."""
    gpus = facts.gpus
    ccs = [Version(g.cc) for g in gpus if g.compute_capability != (0, 0)]  # (0, 0): unread
    links = facts.link_summary()
    h = facts.host
    values: dict[str, FactValue] = {
        "framework": framework,
        "plan.replicas": replicas,
        "gpus.count": len(gpus),
        "gpus.names": tuple(g.name for g in gpus),
        "gpus.min_cc": min(ccs) if ccs else None,
        "gpus.max_cc": max(ccs) if ccs else None,
        "gpus.consumer": any(g.is_consumer for g in gpus),
        "gpus.mig": any(g.mig_enabled for g in gpus),
        "gpus.mixed": len({(g.name, g.memory_bytes) for g in gpus}) > 1,
        # the NUMA nodes the GPUs hang off (None: some GPU's node is unknown)
        "gpus.numa_nodes": (len({g.numa_node for g in gpus})
                            if gpus and all(g.numa_node is not None for g in gpus) else None),
        "links.all_nvlink": links.all_nvlink,
        "links.any_pcie_only": links.any_pcie_only,
        "links.p2p_unsupported": links.p2p_unsupported,
        "links.cross_socket": links.cross_socket,
        "links.any_nvlink": links.any_nvlink,
        "links.any_switch": links.any_switch,
        "links.any_host_path": links.any_host_path,
        "plan.nodes": nodes,
        "nccl.version": _version(facts.framework(framework).nccl),
        "platform.nvswitch": facts.platform.nvswitch,
        "platform.hypervisor": facts.platform.hypervisor,
        "platform.vm": bool(facts.platform.hypervisor),
        "platform.rdma_link_layer": facts.platform.rdma_link_layer,
        "platform.rdma_devices": facts.platform.rdma_devices,
        "platform.rdma_count": len(facts.platform.rdma_devices),
        "platform.fabric_manager": facts.platform.fabric_manager,
        "platform.fabric_manager_mismatch": (
            None if not facts.platform.fabric_manager or not facts.driver_version
            else facts.platform.fabric_manager != facts.driver_version),
        "platform.master_ifname": facts.platform.master_ifname,
        "platform.hostname_loopback": facts.platform.hostname_loopback,
        "driver.version": _version(facts.driver_version),
        "driver.cuda": _version(facts.cuda_driver_version),
        "host.shm_mb": None if h.shm_bytes is None else h.shm_bytes // (1 << 20),
        "host.container": h.container,
        "host.in_container": bool(h.container),
        "host.wsl2": h.wsl2,
        "host.sagemaker": h.sagemaker,
        "host.aws": h.aws,
        "host.efa": h.efa,
        "host.infiniband": h.infiniband,
        "host.iommu": h.iommu,
        "host.platform": h.platform,
        "host.machine": h.machine,
        # Apple silicon under macOS: PyTorch's MPS device (one GPU, no collective backend)
        "host.mps": h.platform == "darwin" and h.machine in ("arm64", "aarch64"),
        "host.numa_nodes": h.numa_nodes,
        "host.numa_memory_only": h.numa_memory_only,
        "host.amd_gpus": h.amd_gpus,
        "host.cuda_compat": h.cuda_compat,
        "host.port_range": h.port_range,
    }
    for fw in ("torch", "tensorflow", "keras"):
        info = facts.framework(fw)
        values[f"{fw}.installed"] = info.installed
        values[f"{fw}.version"] = _version(info.version)
        values[f"{fw}.cuda"] = _version(info.cuda)
        values[f"{fw}.nccl"] = _version(info.nccl)
        values[f"{fw}.max_arch"] = _max_arch(info.archs)
        values[f"{fw}.imported"] = info.imported
        values[f"{fw}.gpu_kernels"] = _kernel_coverage(info.archs, gpus)
        values[f"{fw}.build"] = info.build
        values[f"{fw}.hip"] = _version(info.hip)
    build = values.get(f"{framework}.cuda") if framework in ("torch", "tensorflow") else None
    driver_cuda = values["driver.cuda"]
    if isinstance(build, Version) and isinstance(driver_cuda, Version):
        values["driver.older_than_build"] = driver_cuda < Version(f"{build.major}.{build.minor}")
        # CUDA 11+ runs a build on any driver of its major release (minor version
        # compatibility); a driver of an older major release cannot run it at all
        # (cudaErrorInsufficientDriver)
        values["driver.cuda_major_behind"] = driver_cuda.major < build.major
    else:
        values["driver.older_than_build"] = values["driver.cuda_major_behind"] = None
    values["host.master_port_ephemeral"] = _in_port_range(facts.env_map.get("MASTER_PORT"),
                                                          h.port_range)
    for name, value in facts.env:
        values[f"env.{name}"] = value
    return values


def _in_port_range(port: str | None, port_range: str) -> bool | None:
    """Whether ``port`` lies in the kernel's ephemeral range "low-high"; None: either unknown."""
    low, _, high = port_range.partition("-")
    if not (port or "").strip().isdigit() or not low.isdigit() or not high.isdigit():
        return None
    return int(low) <= int(str(port).strip()) <= int(high)


_MESSAGE_FACT = re.compile(r"\{([a-z_]+\.[A-Za-z0-9_]+)\}")


def fill_message(message: str, values: Mapping[str, FactValue]) -> str:
    """A rule's message with each ``{fact}`` replaced by this machine's value (so the advice
    names the version it is about); an unknown fact reads "unknown"."""

    def value(m: re.Match[str]) -> str:
        v = values.get(m.group(1))
        if v is None or v == "":
            return "unknown"
        return ",".join(v) if isinstance(v, tuple) else str(v)

    return _MESSAGE_FACT.sub(value, message)


def _compare(
    actual: FactValue, op: str, raw: str, pattern: re.Pattern[str] | None = None
) -> bool | None:
    """None when the comparison cannot be made (unknown fact or incomparable value)."""
    if actual is None:
        return None
    if op == "matches":
        items = actual if isinstance(actual, tuple) else (str(actual),)
        rx = pattern or re.compile(raw, re.IGNORECASE)
        return any(rx.search(str(i)) for i in items)
    if op == "contains":
        items = actual if isinstance(actual, tuple) else (str(actual),)
        return raw in items if isinstance(actual, tuple) else raw in str(actual)
    if op == "in":
        options = [o.strip().strip("'\"") for o in raw.strip("[]").split(",")]
        return str(actual) in options
    expected: Any
    value: Any = actual
    if isinstance(actual, bool):
        expected = raw.lower() in ("true", "1", "yes")
    elif isinstance(actual, int):
        try:
            expected = int(raw)
        except ValueError:
            return None
    elif isinstance(actual, Version):
        expected = _version(raw)
        if expected is None:
            return None
    elif isinstance(actual, tuple):
        return None
    else:
        expected, value = raw, str(actual)
    if isinstance(value, bool) and op not in ("==", "!="):
        return None
    return bool(_ORDER_OPS[op](value, expected))


def clause_holds(clause: Clause, values: Mapping[str, FactValue]) -> bool:
    """Whether a clause holds; a clause on an unknown fact never holds (negated or not)."""
    if clause.fact.startswith("env.") and clause.fact not in values:
        actual: FactValue = ""  # an unset variable reads as empty
    else:
        actual = values.get(clause.fact)
    if clause.op == "truthy":
        if actual is None:
            return False
        result: bool | None = bool(actual)
    else:
        result = _compare(actual, clause.op, clause.value, clause.pattern)
    if result is None:
        return False
    return result != clause.negate


def fired(rules: Iterable[Rule], facts: Facts, framework: str,
          replicas: int | None = None) -> tuple[Rule, ...]:
    """The rules whose clauses all hold for these facts and framework, in order. ``replicas``
    (``plan.replicas``) is the number of devices a multi-device strategy would use: the GPUs
    after ``devices=`` and CUDA_VISIBLE_DEVICES, or the logical CPUs in TF's test mode."""
    values = fact_values(facts, framework, replicas)
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


def table_id(d: Any, what: str, keys: frozenset[str] | set[str], origin: str, where: str) -> str:
    """The id of one ``[[what]]`` table of a data file (rules, signatures, remedies), after
    checking it is a table with a non-empty id and no key outside ``keys``; every problem an
    `InvalidRuleError` naming the entry and the file."""
    if not isinstance(d, Mapping):
        raise InvalidRuleError(where, f"a {what} must be a table ([[{what}]]), not {d!r}", origin)
    tid = d.get("id")
    if not isinstance(tid, str) or not tid.strip():
        raise InvalidRuleError(where, f"every {what} needs an id, not {tid!r}", origin)
    tid = tid.strip()
    extra = sorted(set(d) - set(keys))
    if extra:
        raise InvalidRuleError(tid, f"unknown key(s) {extra}; allowed: {sorted(keys)}", origin)
    return tid


def data_tables(text: str, origin: str, what: str, version: int,
                extra_keys: frozenset[str] = frozenset()) -> tuple[dict[str, Any], list[Any]]:
    """One versioned TOML data file of ``[[what]]`` tables (signatures, remedies), parsed with
    its bounds and checked: the top-level keys, the version (1 to ``version``), the array of
    tables. Returns the whole document and the tables; every problem an InvalidRuleError."""
    from . import bounded as _bounded

    try:
        data = _bounded.parse_toml(text, origin)
    except FileFormatError as exc:
        raise InvalidRuleError("?", exc.problem, origin) from None
    unknown = sorted(set(data) - {"version", what} - extra_keys)
    if unknown:
        raise InvalidRuleError("?", f"unknown top-level key(s) {unknown}; write a version and "
                               f"[[{what}]] tables", origin)
    found = data.get("version")
    if isinstance(found, bool) or not isinstance(found, int) or not 1 <= found <= version:
        raise InvalidRuleError("?", f"version must be an integer from 1 to {version} (this "
                               f"resilient_strategy reads version {version}), not {found!r}",
                               origin)
    tables = data.get(what, [])
    if not isinstance(tables, list):
        raise InvalidRuleError("?", f"'{what}' must be an array of tables ([[{what}]])", origin)
    return data, tables
