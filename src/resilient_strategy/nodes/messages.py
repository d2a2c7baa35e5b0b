"""What the nodes of a job (and the local ranks of a node) tell each other, as typed values.
JSON only at the edge: each value's ``to_json`` is what `store.Channel.put` (or the local
agreement's file) carries, and ``from_json`` reads it back, checked: a message of another
version is a typed `MultiNodeError`, never a KeyError far from where it came in."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from ..core.knowledge.candidate_env import refused
from ..core.measures.probe import ProbeResult, ProbeSpec
from ..core.values.bounded import parse_json
from ..core.values.candidate import CandidateKey
from ..core.values.facts import NodeFacts
from ..errors import FileFormatError, MultiNodeError, StoreValueError
from ..vocab import BACKENDS, FRAMEWORKS

_SAME_VERSION = "run the same version of resilient_strategy on every node"

#: The largest value this package reads from the job's store: far above its largest message (a
#: decision with every result and every node's facts: tens of KiB), far below a memory problem.
MAX_VALUE_BYTES = 1 << 20
#: The deepest nesting of a message (a decision's node summary's facts: 5 levels).
MAX_VALUE_DEPTH = 16
#: The most characters of free text (a reason, a detail) a message may carry into this node's
#: words; more is cut.
MAX_WORDS = 500
#: Bounds of a probe node 0 asks for: beyond them it is no probe this package sends.
_MAX_DEVICES = 1024
_MAX_WORLD = 1 << 16
_MAX_MESSAGE_BYTES = 1 << 34
_MAX_TIMEOUT_S = 7 * 24 * 3600.0


def decode(raw: bytes, key: str) -> dict[str, Any]:
    """The JSON object at ``key`` of the job's store, bounded (`MAX_VALUE_BYTES`,
    `MAX_VALUE_DEPTH`); `StoreValueError` naming ``key`` for anything else (never a
    ``RecursionError`` or ``UnicodeDecodeError`` from deep inside)."""
    if len(raw) > MAX_VALUE_BYTES:
        raise StoreValueError(key, f"{len(raw)} bytes, more than the {MAX_VALUE_BYTES} a "
                              "message of this package takes")
    try:
        data = parse_json(raw, key, max_depth=MAX_VALUE_DEPTH)
    except FileFormatError as exc:
        raise StoreValueError(key, exc.problem) from None
    if not isinstance(data, dict):
        raise StoreValueError(key, f"a JSON {type(data).__name__}, not an object")
    return data


def words(v: Any, limit: int = MAX_WORDS) -> str:
    """Free text another process wrote, as this node may print it: one line, every control
    character (a terminal's escape, a newline) shown escaped, at most ``limit`` characters."""
    text = "" if v is None else str(v)
    out = "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in text[:limit * 2])
    return out if len(out) <= limit else out[:limit - 3] + "..."


def result_of(d: Any) -> ProbeResult | None:
    """A probe result another node sent (None for none)."""
    if d is None:
        return None
    try:
        return ProbeResult.from_dict(d)
    except ValueError as exc:
        raise MultiNodeError(f"a node sent a probe result this node cannot read: "
                             f"{words(exc, 300)}; "
                             f"{_SAME_VERSION}") from exc


def spec_of(d: Mapping[str, Any]) -> ProbeSpec:
    """The probe node 0 asked every node to run, checked against what node 0 sends: a known
    framework and backend, a candidate key, bounded numbers, and only variables a candidate
    may set (`resilient_strategy.core.knowledge.candidate_env`: never ``LD_PRELOAD``,
    ``PYTHONPATH``, a plugin or a file). `MultiNodeError` for anything else."""
    try:
        env = tuple((k, v) for k, v in d["env"])
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in env):
            raise ValueError("its variables are not strings")
        bad = refused(env)
        if bad:
            raise ValueError("; ".join(why for _, why in bad))
        spec = ProbeSpec(
            candidate=str(d["candidate"]), framework=str(d["framework"]),
            backend=str(d["backend"]), devices=tuple(_whole(x, _MAX_DEVICES) for x in d["devices"]),
            env=env, world_size=_whole(d["world_size"], _MAX_WORLD),
            timeout_s=float(d["timeout_s"]),
            message_bytes=_whole(d["message_bytes"], _MAX_MESSAGE_BYTES),
            train_step=d["train_step"] is True,
            logical_cpus=_whole(d.get("logical_cpus", 0), _MAX_DEVICES),
            sharded=d.get("sharded", False) is True,
        )
        if spec.framework not in FRAMEWORKS or spec.backend not in BACKENDS:
            raise ValueError(f"no probe of {spec.framework!r} / {spec.backend!r}")
        if len(spec.devices) > _MAX_DEVICES:
            raise ValueError(f"{len(spec.devices)} devices")
        if not (math.isfinite(spec.timeout_s) and 0 < spec.timeout_s <= _MAX_TIMEOUT_S):
            raise ValueError(f"a timeout of {spec.timeout_s} s")
        CandidateKey.parse(spec.candidate)
    except (KeyError, TypeError, ValueError) as exc:
        raise MultiNodeError(f"node 0 sent a probe this node cannot read ({words(exc, 300)}); "
                             f"{_SAME_VERSION}") from exc
    return spec


def _whole(v: Any, most: int) -> int:
    """A whole number 0..``most`` (never a bool, a float or a string)."""
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= most:
        raise ValueError(f"{words(v, 40)} is not a whole number up to {most}")
    return v


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
            node=int(_number(d.get("node"))), host=words(d.get("host") or "", 255),
            gpus=gpus if isinstance(gpus, int) and not isinstance(gpus, bool) else None,
            gpu_names=tuple(words(n, 100) for n in names[:_MAX_DEVICES])
            if isinstance(names, list) else (),
            version=_text(d.get("version")), cuda=_text(d.get("cuda")),
            nccl=_text(d.get("nccl")), route=_text(d.get("route")),
            route_how=words(d.get("route_how") or ""), facts=facts,
            unreadable=words(unreadable))


def _text(v: Any) -> str | None:
    return None if v is None or isinstance(v, bool) else words(v, 255)


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
        return cls(d.get("ok") is True, words(d.get("why", "")))


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
        return cls(d.get("ok") is True,
                   node if isinstance(node, int) and not isinstance(node, bool) else None,
                   words(d.get("why", "")), d.get("lost") is True)


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
        if any(r.candidate != k for k, r in results.items()):
            raise MultiNodeError("node 0's decision holds a result under another candidate's "
                                 f"key; {_SAME_VERSION}")
        nodes = d.get("nodes")
        trace = d.get("multinode_trace")
        chosen = d.get("chosen")
        return cls(
            chosen=chosen if isinstance(chosen, str) else None, results=results,
            proven=d.get("proven") is True, from_cache=d.get("from_cache") is True,
            nodes={str(k): NodeSummary.from_json(v) for k, v in nodes.items()}
            if isinstance(nodes, Mapping) else {},
            multinode_trace=tuple(words(x, 2000) for x in trace[:256])
            if isinstance(trace, list) else (),
            error=words(d.get("error") or ""))


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
            return cls("abort", why=words(d.get("why", "")))
        if kind != "decision":
            raise MultiNodeError(f"node 0's message is of no known kind ({words(kind, 40)}); "
                                 f"{_SAME_VERSION}")
        return cls("decision", decision=NodeDecision.from_json(d))
