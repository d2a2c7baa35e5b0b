"""Multi-node jobs: prove the links between nodes, and agree through the launcher's own store.

Under ``torchrun --nnodes N`` (``WORLD_SIZE > LOCAL_WORLD_SIZE``) local rank 0 of every node
speaks for its node, and they meet in the job's TCPStore: torchrun's agent store at
``MASTER_ADDR:MASTER_PORT`` (``TORCHELASTIC_USE_AGENT_STORE=True``: every process is a client),
else the store that global rank 0 hosts there with ``multi_tenant=True`` (which
``init_process_group`` later reuses in the same process). Our keys live under their own prefix
with the restart count (``resilient_strategy/v1/<run id>/<restart>/``), apart from torch's own.

The decider of node 0 plans; for each candidate the planner wants proven it opens a *round*:
every node proves the candidate's local group (when it has more than one process), the nodes
tell each other, and when every local group passed, one process per node joins a probe group
spanning all nodes (through the same store) that runs the checked all-reduce, the bandwidth
measurement and a DDP step, under the probe's deadline, with the backend and environment that
node would use. Node 0 combines the nodes' results and plans on; when it has chosen, it
publishes the decision and the results that justify it. Every other node re-plans from those
results with its own facts, says whether its facts contradict the decision (a different GPU
count, no GPU, a build that cannot run it), and node 0 publishes the verdict: the job trains,
or every node stops with `NodeMismatchError`. A node that stops answering ends the
decision on every node with `NodeLostError` within the deadlines; no decision file is
shared between nodes (the ranks of one node still share theirs, `agreement`).

Remedies between nodes are measured, never guessed: after plain NCCL fails between nodes,
NCCL with ``NCCL_SOCKET_IFNAME`` set to the interface that routes to the rendezvous host on each
node (from the kernel's routing table, `route_interface`; the value ``@route`` in a
candidate stands for it, so every node keeps the same candidate key), then NCCL over sockets
(``NCCL_IB_DISABLE=1 NCCL_NET=Socket``). A variable the user set is never overridden. When no
backend works between the nodes, the planner's estimate picks a slower backend across all
nodes, or node 0 alone with accumulation keeping the global batch (the other nodes exit 0).

The mid-run relaunch across nodes belongs to the supervisor (``resilient-strategy run``):
`record_fault` / `recorded_faults` are its hook: a node writes the fault it saw into
the store, every node's supervisor reads it before relaunching.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..core.measures.probe import ProbeResult, ProbeSpec
from ..errors import MultiNodeError, NodeLostError, NodeMismatchError, ResilientStrategyError
from ..vocab import PROCESS_GROUP_BACKENDS

if TYPE_CHECKING:
    from ..core.call.options import Options
    from ..core.planning.plan import Plan
    from ..core.values.candidate import Candidate
    from ..core.values.facts import Facts

from ..core.knowledge.nodefacts import node_facts
from ..core.planning.decision import Decision
from ..core.values.facts import NodeFacts
from .crossprobe import CrossProber, Prober, combine, run_cross_probe
from .messages import Ack, NodeDecision, NodeSummary, NodeVerdict, Round, RoundReport
from .routes import between_nodes, remedy_rules, route_to_master
from .store import HEARTBEAT_STALE_S, Channel, Heartbeat, Job, first_line, open_store

log = logging.getLogger("resilient_strategy")
__all__ = ["MultiNodeError", "NodeLostError", "NodeMismatchError", "agreed_decision"]

#: Slack on every wait between nodes, beyond the probe's own deadline (at least this many
#: seconds, or half the probe timeout): the nodes start, import and time out a little apart.
MARGIN_FLOOR_S = 10.0



def node_summary(facts: Facts, framework: str, job: Job, env: Mapping[str, str]) -> NodeSummary:
    """What a node tells the others about itself (shown in every node's trace), with its facts
    that matter (``facts``: `NodeFacts` as JSON), which node 0 compares before any probe."""
    info = facts.framework(framework)
    iface, how = route_to_master(env)
    host = socket.gethostname()
    mine = node_facts(facts, framework, job.node, host)
    if iface and not mine.route:  # the route read now (the facts may predate MASTER_ADDR)
        mine = replace(mine, route=iface)
    return NodeSummary(
        node=job.node, host=host, gpus=len(facts.gpus),
        gpu_names=tuple(sorted({g.name for g in facts.gpus})), version=info.version,
        cuda=info.cuda, nccl=info.nccl, route=iface, route_how=how, facts=mine)


def with_nodes(facts: Facts, summaries: Mapping[Any, NodeSummary]) -> Facts:
    """``facts`` with the job's nodes as each described itself (`node_summary`'s ``facts``),
    for the planner to compare; a node whose description is missing or unreadable is left
    out (said in the log), never guessed."""
    nodes: list[NodeFacts] = []
    for key, summary in summaries.items():
        if summary.facts is not None:
            nodes.append(summary.facts)
        else:
            log.warning("resilient_strategy: node %s sent facts that cannot be read (%s); "
                        "it is not compared with the others", key, summary.unreadable)
    return replace(facts, nodes=tuple(sorted(nodes, key=lambda n: n.node)))


def contradictions(
    facts: Facts, framework: str, chosen: Candidate | None, leader: NodeSummary | None
) -> list[str]:
    """Why this node cannot run ``chosen`` as node 0 decided it; [] when it can. Pure."""
    if chosen is None or chosen.num_replicas <= 1:
        return []  # nothing to run, or node 0 trains alone and this node exits
    out: list[str] = []
    info = facts.framework(framework)
    if chosen.devices:
        n = len(facts.gpus)
        if n == 0:
            out.append("this node sees no GPU")
        elif n < len(chosen.devices):
            out.append(f"this node sees {n} GPU(s); the decision uses {len(chosen.devices)} per node")
        elif leader is not None and leader.gpus is not None and leader.gpus != n:
            out.append(f"node 0 sees {leader.gpus} GPU(s) and this node {n}: node 0's "
                       "decision cannot speak for this node")
        if not info.cuda:
            out.append(f"{framework} {info.version or '?'} here is a CPU-only build")
        elif chosen.backend == "nccl" and not info.nccl:
            out.append(f"{framework} {info.version or '?'} here has no NCCL")
    return out


@dataclass
class _Node:
    """One node's local rank 0 during the decision."""

    job: Job
    channel: Channel
    facts: Facts
    opts: Options
    env: Mapping[str, str]
    local_prober: Prober
    cross_prober: CrossProber
    margin_s: float
    summary: NodeSummary = field(default_factory=lambda: NodeSummary(0))
    rounds: int = 0
    #: nodes already silent at the end of the last attempt (their verdict never came): at a
    #: relaunch each gets the heartbeat window to join, not the whole join window
    silent: frozenset[int] = frozenset()

    def others(self) -> list[int]:
        return [k for k in range(self.job.nodes) if k != self.job.node]

    def lost_peer(self) -> str:
        """Why the probe across nodes is pointless now (a node stopped beating), or ""."""
        now = time.monotonic()
        try:
            lost = [k for k in self.others() if self.channel.stale(k, now)]
        except (RuntimeError, OSError) as exc:
            return f"the job's store stopped answering ({first_line(exc)})"
        return f"node(s) {lost} stopped beating" if lost else ""

    def run_round(self, n: int, spec: ProbeSpec) -> RoundReport:
        """This node's part of round ``n``: its local group, then the group across nodes."""
        t0 = time.monotonic()
        here = replace(spec, env=tuple(between_nodes(spec.backend, dict(spec.env), self.env).items()))
        local = None
        if self.job.local_world > 1 and spec.backend in PROCESS_GROUP_BACKENDS:
            local = self.local_prober(replace(here, world_size=self.job.local_world), self.env)
        mine_ok = local is None or local.ok
        self.channel.put(f"r{n}/local/{self.job.node}", Ack(mine_ok).to_json())
        peers_ok = all(
            self.channel.take_as(
                f"r{n}/local/{k}", Ack.from_json, spec.timeout_s + self.margin_s,
                f"node {k} did not finish its local probe of round {n}", who=k).ok
            for k in self.others()
        )
        cross = None
        if mine_ok and peers_ok:
            cross = self.cross_prober(here, self.env, self.job, f"{self.job.prefix}r{n}/pg/",
                                      self.lost_peer)
        out = RoundReport(self.job.node, local, cross, self.summary.route,
                          round(time.monotonic() - t0, 3))
        self.channel.put(f"r{n}/result/{self.job.node}", out.to_json())
        return out

    # ----- node 0 ------------------------------------------------------------------------------
    def lead(self, decide: Callable[..., Any], clock: Callable[[], float]
             ) -> tuple[Decision, NodeDecision]:
        join = 2 * self.margin_s  # the nodes start together (after torchrun's rendezvous)
        nodes = {0: self.summary}
        for k in self.others():
            window = min(join, HEARTBEAT_STALE_S) if k in self.silent else join
            nodes[k] = self.channel.take_as(f"hello/{k}", NodeSummary.from_json, window,
                                            f"node {k} did not join", who=k)

        def across(spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
            if spec.identity.node_local:  # node 0 alone: no round
                return self.local_prober(spec, env)
            self.rounds += 1
            n = self.rounds
            self.channel.put(f"round/{n}", Round("probe", spec=spec).to_json())
            reports = [self.run_round(n, spec)] + [
                self.channel.take_as(
                    f"r{n}/result/{k}", RoundReport.from_json, spec.timeout_s + self.margin_s,
                    f"node {k} sent no result for its probe of {spec.candidate}", who=k)
                for k in self.others()
            ]
            return combine(spec, reports, self.job)

        # the nodes' facts compared before any probe (a difference that matters is a finding
        # in the trace, or rules NCCL between the nodes out)
        d = decide(with_nodes(self.facts, nodes), self.opts, self.env, across, clock,
                   cross_node=True)
        p, results, proven = d.plan, dict(d.results), bool(d.proven)
        payload = NodeDecision(p.chosen.key if p.chosen else None, results, proven,
                               nodes={str(k): v for k, v in nodes.items()})
        self.channel.put(f"round/{self.rounds + 1}",
                         Round("decision", decision=payload).to_json())
        bad: dict[int, str] = {}
        for k in self.others():
            try:
                ack = self.channel.take_as(
                    f"ack/{k}", Ack.from_json, self.margin_s, f"node {k} did not confirm", who=k)
            except NodeLostError as exc:
                self.channel.put("verdict", NodeVerdict(False, k, str(exc), lost=True).to_json())
                raise
            if not ack.ok:
                bad[k] = ack.why
        self.channel.put("verdict", NodeVerdict(
            not bad, min(bad) if bad else None,
            "; ".join(f"node {k}: {w}" for k, w in bad.items())).to_json())
        if bad:
            raise NodeMismatchError(
                "the nodes disagree, so no node trains: " + "; ".join(
                    f"node {k}: {w}" for k, w in sorted(bad.items())))
        return Decision(p, results, False, proven), payload

    def abort(self, why: str) -> None:
        """Node 0 failed: tell the others now rather than let them wait out their deadlines."""
        with contextlib.suppress(MultiNodeError, RuntimeError, OSError):
            if self.channel.store.check([self.channel.prefix + "verdict"]):
                return  # the others already have the verdict (a mismatch, or a lost node)
            self.channel.put(f"round/{self.rounds + 1}", Round("abort", why=why).to_json())
            self.channel.put("verdict", NodeVerdict(False, 0, why, lost=True).to_json())

    # ----- every other node --------------------------------------------------------------------
    def follow(self) -> tuple[Decision, NodeDecision]:
        wait = self.opts.timeout_s + 2 * self.margin_s
        for n in range(1, 64):
            msg = self.channel.take_as(
                f"round/{n}", Round.from_json, wait + (self.opts.timeout_s if n == 1 else 0),
                "node 0 sent neither a probe nor its decision", who=0)
            if msg.kind == "abort":
                msg = self.confirmed(n, msg, wait)
            if msg.spec is not None:
                self.run_round(n, msg.spec)
                continue
            if msg.decision is None:  # the words are the store's value, escaped and bounded
                raise MultiNodeError(
                    f"the decision was aborted through the job's store "
                    f"({self.channel.prefix}round/{n}, where node 0 writes when it fails): "
                    f"\"{msg.why}\"")
            return self.accept(msg.decision), msg.decision
        raise MultiNodeError("node 0 asked for more probes than a decision can need")

    def confirmed(self, n: int, abort: Round, wait_s: float) -> Round:
        """Node 0's message of round ``n`` once an abort there is node 0's: node 0 writes its
        abort after its decider stopped beating, so an abort is believed once node 0's
        heartbeat has stopped (`HEARTBEAT_STALE_S`) or node 0 wrote nothing else within
        ``wait_s``; an abort that node 0, still beating, replaces with its own message (one
        another process wrote first) is that message."""
        deadline = time.monotonic() + wait_s
        key = f"round/{n}"
        while (now := time.monotonic()) < deadline:
            try:
                if self.channel.stale(0, now):
                    return abort
                got = self.channel.peek_as(key, Round.from_json)
            except (RuntimeError, OSError):
                return abort  # the store is gone with node 0
            if got is not None and got.kind != "abort":
                log.warning("resilient_strategy: node %d: an abort at %r in the job's store was "
                            "not node 0's (node 0 kept beating and wrote its own message there)",
                            self.job.node, self.channel.prefix + key,
                            extra={"store_key": self.channel.prefix + key})
                return got
            time.sleep(self.channel.poll_s)
        return abort

    def accept(self, payload: NodeDecision) -> Decision:
        results = dict(payload.results)
        p = _replan(with_nodes(self.facts, payload.nodes), self.opts, results, payload.proven)
        problems = contradictions(self.facts, self.opts.framework, p.chosen,
                                  payload.nodes.get("0"))
        mine = p.chosen.key if p.chosen else None
        if mine != payload.chosen and not problems:
            problems.append(f"from node 0's results this node plans {mine}, not node 0's "
                            f"{payload.chosen}: the nodes see different machines or options")
        self.channel.put(f"ack/{self.job.node}", Ack(not problems, "; ".join(problems)).to_json())
        verdict = self.channel.take_as(
            "verdict", NodeVerdict.from_json, 2 * self.margin_s, "node 0 gave no verdict", who=0)
        if problems:
            raise NodeMismatchError(
                f"node {self.job.node} cannot run node 0's decision ({payload.chosen}): "
                + "; ".join(problems) + ". Every node stops.")
        if not verdict.ok:
            kind = NodeLostError if verdict.lost else NodeMismatchError
            raise kind(f"no node trains: {verdict.why}")
        return Decision(p, results, False, payload.proven)


def _replan(facts: Facts, opts: Options, results: Mapping[str, ProbeResult], proven: bool) -> Plan:
    from ..core.planning.plan import plan

    p = plan(facts, opts.rules, results, opts)
    if p.next_probe is not None and not proven:
        p = replace(p, chosen=p.next_probe, next_probe=None)
    return p


def multinode_options(opts: Options, facts: Facts) -> Options:
    """``opts`` with the remedies between nodes (only where NCCL could run: a GPU build)."""
    if not facts.gpus or not facts.framework(opts.framework).cuda:
        return opts
    return replace(opts, rules=(*opts.rules, *remedy_rules()))


def trace_lines(job: Job, payload: NodeDecision, p: Plan) -> list[str]:
    """What every node's trace says about the decision between nodes."""
    lines = [f"Node {job.node} of {job.nodes}: the nodes agreed through the job's store at "
             f"{job.store_text}; node 0 decided, every node checked it against its own facts."]
    nodes = payload.nodes
    for k in sorted(nodes, key=lambda x: int(x) if x.isdigit() else 0):
        n = nodes[k]
        lines.append(
            f"Node {k} ({n.host}): {n.gpus} GPU(s), torch {n.version}"
            f"; route to the rendezvous host: {n.route or 'none'} ({n.route_how}).")
    results = payload.results
    across = [(k, r) for k, r in results.items() if ("nodes", str(job.nodes)) in r.extra]
    if across:
        lines.append(f"Probed across {job.nodes} nodes: " + "; ".join(
            f"{k}: {'ok' if r.ok else r.status} ({r.why() if not r.ok else r.detail})"
            for k, r in across) + ".")
    elif payload.proven:
        lines.append(f"Nothing was probed across the {job.nodes} nodes (nothing needed it).")
    else:
        lines.append(f"Nothing was probed across the {job.nodes} nodes: the choice is UNPROVEN "
                     "(probing is off).")
    c = p.chosen
    if c is not None and c.num_replicas == 1:
        lines.append(
            f"No backend was proven between the nodes that beats one node: node 0 trains alone "
            f"on {c.label} with {c.accumulation_steps} accumulation step(s) keeping the global "
            f"batch; the other nodes exit 0.")
    elif c is not None:
        lines.append(f"Chosen across all {job.nodes} nodes: {c.label}, {c.num_replicas} replicas.")
    return lines


def agreed_decision(
    facts: Facts, opts: Options, env: Mapping[str, str], prober: Prober,
    clock: Callable[[], float], decide: Callable[..., Any],
    *, cross_prober: CrossProber = run_cross_probe, silent: Collection[int] = (),
) -> Decision:
    """The decision of a multi-node job, the same on every rank of every node (see the module's
    docstring). ``decide``: the executor's, passed in (this module imports no executor).
    ``silent``: nodes whose verdict on the last attempt never came (a relaunch): node 0 gives
    each the heartbeat window to join; one that does not is lost (`NodeLostError`
    naming it), and the supervisor goes on without it."""
    job = Job.from_env(env)
    if job is None:  # no store named: the nodes cannot talk, each plans from the rules alone
        d: Decision = decide(facts, opts, env, prober, clock)
        return d
    opts = multinode_options(opts, facts)
    from .onenode import Agreement

    local = Agreement.for_job(env, facts.fingerprint(), opts.cache_dir)
    margin = max(MARGIN_FLOOR_S, opts.timeout_s / 2)
    if opts.launch.local_rank != 0:
        return _follow_local(facts, opts, local, opts.budget_s + 4 * opts.timeout_s + 6 * margin)
    node: _Node | None = None
    try:
        store = open_store(job, opts.timeout_s + margin)
        node = _Node(job, Channel(store, job.prefix), facts, opts, env, prober, cross_prober,
                     margin, silent=frozenset(silent))
        node.summary = node_summary(facts, opts.framework, job, env)
        with Heartbeat(open_store(job, opts.timeout_s + margin, client=True), job.prefix,
                       job.node):
            if job.node == 0:
                decided, payload = node.lead(decide, clock)
            else:
                node.channel.put(f"hello/{job.node}", node.summary.to_json())
                decided, payload = node.follow()
    except ResilientStrategyError as exc:
        if node is not None and job.node == 0:
            node.abort(str(exc))
        with contextlib.suppress(ResilientStrategyError):
            local.publish(NodeDecision(None, error=str(exc)).to_json())
        raise
    p, results, from_cache, proven = (decided.plan, dict(decided.results), decided.from_cache,
                                      decided.proven)
    lines = trace_lines(job, payload, p)
    if job.node != 0 and p.chosen is not None and p.chosen.node_local:
        log.warning("resilient_strategy: node %d: the link between the nodes failed, so node 0 "
                    "trains alone on its own GPUs (%s); this node's ranks exit 0 at scope() / "
                    "prepare().", job.node, p.chosen.label)
    elif job.node != 0 and p.chosen is not None and p.chosen.num_replicas == 1:
        log.warning("resilient_strategy: node %d: no backend between the nodes beats node 0 "
                    "alone, so node 0 trains alone (%s); this node's ranks exit 0 at scope() "
                    "/ prepare().", job.node, p.chosen.label)
    p = _with_notes(p, lines)
    if job.local_world > 1:
        local.publish(NodeDecision(p.chosen.key if p.chosen else None, results, proven,
                                   from_cache, payload.nodes, tuple(lines)).to_json())
    return Decision(p, results, from_cache, proven)


def _follow_local(facts: Facts, opts: Options, agreement: Any, timeout_s: float) -> Decision:
    """A local rank other than 0: take the decision its node's local rank 0 published."""
    payload = NodeDecision.from_json(agreement.wait(timeout_s))
    if payload.error:
        raise MultiNodeError(f"local rank 0 of this node stopped: {payload.error}")
    results = dict(payload.results)
    p = _replan(with_nodes(facts, payload.nodes), opts, results, payload.proven)
    if (p.chosen.key if p.chosen else None) != payload.chosen:
        raise MultiNodeError(
            f"this rank planned {p.chosen.key if p.chosen else None} but local rank 0 chose "
            f"{payload.chosen}: pass the same arguments on every rank")
    return Decision(_with_notes(p, payload.multinode_trace), results, payload.from_cache,
                    payload.proven)


def _with_notes(p: Plan, lines: Sequence[str]) -> Plan:
    """``p`` with ``lines`` added to its trace (as ``multi_node`` notes)."""
    from ..core.trace.event import Note

    return replace(p, events=(*p.events, *(Note("multi_node", line) for line in lines)))
