"""What the nodes of a job (and the local ranks of a node) tell each other, as typed values.
JSON only at the edge: each value's ``to_json`` is what `store.Channel.put` (or the local
agreement's file) carries, and ``from_json`` reads it back, checked: a message of another
version is a typed `MultiNodeError`, never a KeyError far from where it came in."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..core.measures.probe import ProbeResult, ProbeSpec
from ..core.values.facts import NodeFacts
from ..errors import MultiNodeError

_SAME_VERSION = "run the same version of resilient_strategy on every node"


def result_of(d: Any) -> ProbeResult | None:
    """A probe result another node sent (None for none)."""
    if d is None:
        return None
    try:
        return ProbeResult.from_dict(d)
    except ValueError as exc:
        raise MultiNodeError(f"a node sent a probe result this node cannot read: {exc}; "
                             f"{_SAME_VERSION}") from exc


def spec_of(d: Mapping[str, Any]) -> ProbeSpec:
    """The probe node 0 asked every node to run."""
    try:
        return ProbeSpec(
            candidate=str(d["candidate"]), framework=str(d["framework"]),
            backend=str(d["backend"]), devices=tuple(int(x) for x in d["devices"]),
            env=tuple((str(k), str(v)) for k, v in d["env"]),
            world_size=int(d["world_size"]), timeout_s=float(d["timeout_s"]),
            message_bytes=int(d["message_bytes"]), train_step=bool(d["train_step"]),
            logical_cpus=int(d.get("logical_cpus", 0)), sharded=bool(d.get("sharded", False)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MultiNodeError(f"node 0 sent a probe this node cannot read ({exc}); "
                             f"{_SAME_VERSION}") from exc


def _number(v: Any, default: float = 0.0) -> float:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else default


def _object(d: Any, what: str) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise MultiNodeError(f"{what} is not an object; {_SAME_VERSION}")
    return d


@dataclass(frozen=True)
class NodeSummary:
    """What a node tells the others about itself (shown in every node's trace), with its
    facts that matter (None: unreadable, so not compared), which node 0 compares before any
    probe."""

    node: int
    host: str = ""
    gpus: int | None = None
    gpu_names: tuple[str, ...] = ()
    version: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    route: str | None = None
    route_how: str = ""
    facts: NodeFacts | None = None
    #: Why ``facts`` could not be read ("" when they could, or were never sent).
    unreadable: str = ""

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["gpu_names"] = list(self.gpu_names)
        out["facts"] = self.facts.to_dict() if self.facts is not None else None
        del out["unreadable"]
        return out

    @classmethod
    def from_json(cls, d: Any) -> NodeSummary:
        d = _object(d, "a node's summary")
        facts, unreadable = None, ""
        raw = d.get("facts")
        try:
            if not isinstance(raw, Mapping):
                raise ValueError("its summary has none")
            facts = NodeFacts.from_dict(raw)
        except (ValueError, TypeError) as exc:
            unreadable = str(exc)
        gpus = d.get("gpus")
        names = d.get("gpu_names")
        return cls(
            node=int(_number(d.get("node"))), host=str(d.get("host") or ""),
            gpus=gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else None,
            gpu_names=tuple(str(n) for n in names) if isinstance(names, list) else (),
            version=_text(d.get("version")), cuda=_text(d.get("cuda")),
            nccl=_text(d.get("nccl")), route=_text(d.get("route")),
            route_how=str(d.get("route_how") or ""), facts=facts, unreadable=unreadable)


def _text(v: Any) -> str | None:
    return None if v is None or isinstance(v, bool) else str(v)


@dataclass(frozen=True)
class RoundReport:
    """One node's part of a probe round: its local group's result, the group across nodes',
    its route to the rendezvous host, and how long it took."""

    node: int
    local: ProbeResult | None = None
    cross: ProbeResult | None = None
    route: str | None = None
    elapsed_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"node": self.node, "local": self.local.to_dict() if self.local else None,
                "cross": self.cross.to_dict() if self.cross else None, "route": self.route,
                "elapsed_s": self.elapsed_s}

    @classmethod
    def from_json(cls, d: Any) -> RoundReport:
        d = _object(d, "a node's probe report")
        return cls(int(_number(d.get("node"))), result_of(d.get("local")),
                   result_of(d.get("cross")), _text(d.get("route")),
                   _number(d.get("elapsed_s")))


@dataclass(frozen=True)
class Ack:
    """A node's answer to node 0's decision: it can run it, or why not."""

    ok: bool
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"ok": self.ok, "why": self.why}

    @classmethod
    def from_json(cls, d: Any) -> Ack:
        d = _object(d, "a node's answer")
        return cls(d.get("ok") is True, str(d.get("why", "")))


@dataclass(frozen=True)
class NodeVerdict:
    """Node 0's last word: every node trains, or none does (``node``: the first that could
    not; ``lost``: it was lost, not in disagreement)."""

    ok: bool
    node: int | None = None
    why: str = ""
    lost: bool = False

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Any) -> NodeVerdict:
        d = _object(d, "node 0's verdict")
        node = d.get("node")
        return cls(d.get("ok") is True, node if isinstance(node, int) else None,
                   str(d.get("why", "")), d.get("lost") is True)


@dataclass(frozen=True)
class NodeDecision:
    """A decision as it is handed between processes of one job: node 0's to the other nodes,
    and a node's local rank 0's to its other local ranks (``error``: local rank 0 stopped)."""

    chosen: str | None
    results: Mapping[str, ProbeResult] = field(default_factory=dict)
    proven: bool = False
    from_cache: bool = False
    nodes: Mapping[str, NodeSummary] = field(default_factory=dict)
    multinode_trace: tuple[str, ...] = ()
    error: str = ""

    def to_json(self) -> dict[str, Any]:
        return {"chosen": self.chosen,
                "results": {k: v.to_dict() for k, v in self.results.items()},
                "proven": self.proven, "from_cache": self.from_cache,
                "nodes": {k: v.to_json() for k, v in self.nodes.items()},
                "multinode_trace": list(self.multinode_trace), "error": self.error}

    @classmethod
    def from_json(cls, d: Any) -> NodeDecision:
        d = _object(d, "node 0's decision")
        raw = d.get("results", {})
        if not isinstance(raw, Mapping):
            raise MultiNodeError("node 0's decision has no readable results")
        results = {str(k): r for k, v in raw.items() if (r := result_of(v)) is not None}
        nodes = d.get("nodes")
        trace = d.get("multinode_trace")
        chosen = d.get("chosen")
        return cls(
            chosen=chosen if isinstance(chosen, str) else None, results=results,
            proven=d.get("proven") is True, from_cache=d.get("from_cache") is True,
            nodes={str(k): NodeSummary.from_json(v) for k, v in nodes.items()}
            if isinstance(nodes, Mapping) else {},
            multinode_trace=tuple(str(x) for x in trace) if isinstance(trace, list) else (),
            error=str(d.get("error") or ""))


@dataclass(frozen=True)
class Round:
    """Node 0's message of one round: a probe every node runs, its decision, or an abort."""

    kind: Literal["probe", "decision", "abort"]
    spec: ProbeSpec | None = None
    decision: NodeDecision | None = None
    why: str = ""

    def to_json(self) -> dict[str, Any]:
        if self.kind == "probe" and self.spec is not None:
            return {"kind": "probe", "spec": asdict(self.spec)}
        if self.kind == "decision" and self.decision is not None:
            return {"kind": "decision", **self.decision.to_json()}
        return {"kind": "abort", "why": self.why}

    @classmethod
    def from_json(cls, d: Any) -> Round:
        d = _object(d, "node 0's message")
        kind = d.get("kind")
        if kind == "probe":
            return cls("probe", spec=spec_of(_object(d.get("spec"), "node 0's probe")))
        if kind == "abort":
            return cls("abort", why=str(d.get("why", "")))
        return cls("decision", decision=NodeDecision.from_json(d))
