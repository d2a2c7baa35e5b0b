"""The nodes of a multi-node job compared: each node's facts that matter (`NodeFacts`, built
from its `Facts` by `node_facts`), and the differences that matter between them, found before
any probe (`compare`). Pure.

Which differences matter, what each does and why is data: ``node_differences.toml``, every
entry with its public source. An entry names one fact of `NodeFacts` (or ``env`` with the
variables it covers) and a kind:

- ``differs``: the nodes that know the fact do not all report the same value (a node that could
  not read it is no difference; for ``env`` an unset variable is a value: set on one node only);
- ``shared``: two or more nodes report the same known value (the boot id of one host: pods or
  containers of one machine, taken for separate nodes);
- ``any``: some node reports it true (a hostname that resolves to loopback).

and an effect: ``warn`` (a finding in the trace and in ``doctor``), or ``rule_out`` (NCCL
between the nodes is ruled out, except a candidate that sets every variable of ``keep_env``;
node 0's own NCCL, ``nccl/node0``, and gloo between the nodes stay).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ...errors import InvalidRuleError
from ..values.facts import Facts, NodeFacts
from .data import parsed, read_data

KINDS = ("differs", "shared", "any")
EFFECTS = ("warn", "rule_out")
#: The facts of `NodeFacts` an entry may compare (``env`` takes ``variables``).
COMPARED = ("host", "boot_id", "driver", "cuda_driver", "version", "cuda", "nccl", "gpus",
            "gpu_names", "net_plugins", "master_family", "route", "hostname_loopback", "env")
#: The variables a node reports: NCCL's and gloo's own.
NODE_ENV_PREFIXES = ("NCCL_", "GLOO_")
#: Variables that only change what is logged: never a difference worth a finding.
_LOG_ONLY = frozenset({"NCCL_DEBUG", "NCCL_DEBUG_FILE", "NCCL_DEBUG_SUBSYS"})
_KEYS = frozenset({"id", "fact", "kind", "effect", "variables", "keep_env", "message", "source"})


@dataclass(frozen=True)
class Difference:
    """One entry of ``node_differences.toml``."""

    id: str
    fact: str
    kind: str
    effect: str
    message: str
    source: str
    variables: tuple[str, ...] = ()  # env: the variables (prefixes) this entry covers
    keep_env: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class NodeFinding:
    """A difference between the nodes that matters: which nodes, their values, the fix."""

    id: str
    fact: str
    kind: str
    effect: str
    #: the nodes the finding is about (differing from node 0, sharing a host, having the fact)
    nodes: tuple[int, ...]
    #: every node's value, as text ("unset" for a variable a node does not set)
    values: tuple[tuple[int, str], ...]
    message: str
    source: str
    variables: tuple[str, ...] = ()
    keep_env: tuple[tuple[str, str], ...] = ()

    def keeps(self, env: Mapping[str, str]) -> bool:
        """Whether a candidate with ``env`` escapes this finding's ``rule_out``."""
        return bool(self.keep_env) and all(env.get(k) == v for k, v in self.keep_env)


def node_facts(facts: Facts, framework: str, node: int, host: str = "") -> NodeFacts:
    """What this node tells the others about itself (its `Facts`, seen for ``framework``)."""
    info = facts.framework(framework)
    p = facts.platform
    return NodeFacts(
        node=node, host=host, boot_id=p.boot_id, driver=facts.driver_version,
        cuda_driver=facts.cuda_driver_version, framework=framework, version=info.version,
        cuda=info.cuda, nccl=info.nccl, gpus=len(facts.gpus),
        gpu_names=tuple(sorted({g.name for g in facts.gpus})), net_plugins=p.net_plugins,
        master_family=p.master_family, route=p.master_ifname,
        hostname_loopback=p.hostname_loopback, env=node_env(facts.env),
    )


def node_env(env: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The NCCL_* / GLOO_* variables of a node, less those that only change logging."""
    return tuple(sorted((k, v) for k, v in env
                        if k.startswith(NODE_ENV_PREFIXES) and k not in _LOG_ONLY))


# ----- the data ---------------------------------------------------------------------------------
def parse_differences(text: str, origin: str) -> tuple[Difference, ...]:
    """The entries of one ``node_differences.toml``; every problem an `InvalidRuleError`."""
    from .data import data_tables, table_id

    _, tables = data_tables(text, origin, "difference", 1)
    out: list[Difference] = []
    for n, d in enumerate(tables, 1):
        did = table_id(d, "difference", _KEYS, origin, f"#{n}")
        fact, kind, effect = d.get("fact"), d.get("kind", "differs"), d.get("effect", "warn")
        if fact not in COMPARED:
            raise InvalidRuleError(did, f"fact must be one of {COMPARED}, not {fact!r}", origin)
        if kind not in KINDS or effect not in EFFECTS:
            raise InvalidRuleError(did, f"kind must be one of {KINDS} and effect one of "
                                   f"{EFFECTS}, not {kind!r} / {effect!r}", origin)
        variables = d.get("variables", [])
        if (fact == "env") != bool(variables) or not all(isinstance(v, str) for v in variables):
            raise InvalidRuleError(did, "variables (a list of names or prefixes) goes with "
                                   "fact = 'env', and only with it", origin)
        keep = d.get("keep_env", {})
        if not isinstance(keep, Mapping) or not all(isinstance(v, str) for v in keep.values()):
            raise InvalidRuleError(did, "keep_env must be a table of strings", origin)
        message, source = d.get("message"), d.get("source")
        if not (isinstance(message, str) and message.strip() and isinstance(source, str)
                and source.strip()):
            raise InvalidRuleError(did, "every difference needs a message and a source", origin)
        out.append(Difference(did, fact, kind, effect, message.strip(), source.strip(),
                              tuple(variables), tuple(sorted(keep.items()))))
    return tuple(out)


def differences() -> tuple[Difference, ...]:
    """The shipped ``node_differences.toml``, read once per process."""
    return parsed(("node_differences",),
                  lambda: parse_differences(*read_data("node_differences.toml")))


# ----- the comparison ---------------------------------------------------------------------------
def _text(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, tuple):
        return ",".join(str(v) for v in value) or "none"
    return str(value)


def _known(value: Any) -> bool:
    return value is not None and value != ""


def compare(nodes: Sequence[NodeFacts],
            entries: Sequence[Difference] | None = None) -> tuple[NodeFinding, ...]:
    """The differences between ``nodes`` (node 0 first) that ``entries`` (default: the shipped
    data) say matter, in the data's order. Fewer than two nodes: none."""
    if len(nodes) < 2:
        return ()
    nodes = sorted(nodes, key=lambda n: n.node)
    claimed: set[str] = set()  # variables an earlier env entry already reported
    out: list[NodeFinding] = []
    for e in differences() if entries is None else entries:
        if e.fact == "env":
            found = _env_finding(e, nodes, claimed)
            if found is not None:
                out.append(found)
            continue
        raw = [(n.node, getattr(n, e.fact)) for n in nodes]
        # a node with no plugin found reports it (()), unlike a text it could not read ("")
        known = raw if e.fact == "net_plugins" else [(k, v) for k, v in raw if _known(v)]
        odd: list[int] = []
        if e.kind == "differs" and len({v for _, v in known}) > 1:
            first = known[0][1]
            odd = [k for k, v in known if v != first]
            if known[0][0] != nodes[0].node:  # node 0 did not know it: every node named
                odd = [k for k, _ in known]
        elif e.kind == "shared":
            groups: dict[Any, list[int]] = {}
            for k, v in known:
                groups.setdefault(v, []).append(k)
            odd = sorted(k for ks in groups.values() if len(ks) > 1 for k in ks)
        elif e.kind == "any":
            odd = [k for k, v in known if v is True]
        if odd:
            out.append(NodeFinding(e.id, e.fact, e.kind, e.effect, tuple(odd),
                                   tuple((k, _text(v)) for k, v in raw), e.message, e.source,
                                   keep_env=e.keep_env))
    return tuple(out)


def _env_finding(e: Difference, nodes: Sequence[NodeFacts],
                 claimed: set[str]) -> NodeFinding | None:
    envs = [(n.node, dict(n.env)) for n in nodes]
    names = sorted({k for _, env in envs for k in env
                    if k not in claimed and k not in _LOG_ONLY and any(k == v or (v.endswith("_") and k.startswith(v))
                                                for v in e.variables)})
    differing = [k for k in names if len({env.get(k) for _, env in envs}) > 1]
    if not differing:
        return None
    claimed.update(differing)
    first = envs[0][1]
    odd = sorted({k for k, env in envs if any(env.get(v) != first.get(v) for v in differing)})
    values = tuple((k, " ".join(f"{v}={env[v]}" if v in env else f"{v} unset"
                                for v in differing)) for k, env in envs)
    return NodeFinding(e.id, e.fact, e.kind, e.effect, tuple(odd), values, e.message, e.source,
                       tuple(differing), e.keep_env)
