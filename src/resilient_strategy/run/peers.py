"""``resilient-strategy run --nnodes N``: the supervisors of the nodes agree before any worker
starts, and relaunch together.

Each node's supervisor speaks for its node (its ``--node-rank``) in a TCPStore at the rendezvous
endpoint (``--rdzv-endpoint host:port``), reachable before torchrun's agent starts: node 0's
supervisor hosts it there (``multi_tenant``: torch's c10d rendezvous handler in the same process
then reuses the same server, the other nodes' handlers connect to it as clients); every other
node's supervisor connects as a client. The supervisors' keys live under
``resilient_strategy/v1/run-<rdzv id>/attempt<n>/`` (a prefix of their own on the rendezvous
store, apart from torch's rendezvous keys and the workers'), one prefix per launch attempt.

Per attempt: `resilient_strategy.nodes.manynodes.agreed_decision` (node 0 plans and probes across
the nodes, the others check the decision against their facts; heartbeats, mismatches and lost
nodes handled there), with the candidates that failed mid-run excluded on every node. While the
workers run, each supervisor watches the store for the other nodes' fault records
(`resilient_strategy.nodes.store.recorded_faults`) and stops its workers when one appears;
a node that saw the fault itself records it (`resilient_strategy.nodes.store.record_fault`).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..nodes.membership import Change, waiting
from ..nodes.store import (
    HEARTBEAT_STALE_S,
    KEY_VERSION,
    Job,
    open_store,
    read_faults,
    record_fault,
)
from .verdicts import PeerFault, Verdict, VerdictKind

#: The least time between two looks at the store for other nodes' fault records.
PEER_POLL_S = 0.5
#: The longest one look at the store may wait (the watch's connection's timeout): a store that
#: does not answer within it is unreachable for that look.
STORE_LOOK_S = 2.0


@dataclass(frozen=True)
class NodeLink:
    """This node's supervisor in a multi-node ``resilient-strategy run``."""

    node: int  # this node's --node-rank: its name in every attempt
    nodes: int  # the most nodes (--nnodes N, or MAX of MIN:MAX)
    nproc: int
    host: str
    port: int
    run_id: str
    #: the nodes of the current attempt, by --node-rank (node 0 first); () before the first
    #: membership round: all of them
    members: tuple[int, ...] = ()
    #: the fewest nodes the job starts with (MIN of --nnodes MIN:MAX; N for a fixed count)
    min_nodes: int = 0
    #: the fewest nodes it goes on with after a loss (MIN; 1 for a fixed count: node 0 alone)
    floor: int = 1

    @property
    def present(self) -> tuple[int, ...]:
        """The nodes of this attempt (every node before the first membership round)."""
        return self.members or tuple(range(self.nodes))

    @property
    def position(self) -> int:
        """This node's place among the nodes of this attempt (its GROUP_RANK there)."""
        return self.present.index(self.node)

    def with_members(self, members: tuple[int, ...]) -> NodeLink:
        return replace(self, members=tuple(members))

    @classmethod
    def from_torchrun(cls, ns: Any, nproc: int) -> NodeLink | None:
        """From torchrun's parsed options: None unless ``--nnodes`` > 1 with an endpoint."""
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        from ..errors import InvalidOptionError

        if ns is None:
            return None
        nnodes = str(getattr(ns, "nnodes", "1"))
        lo, _, hi = nnodes.partition(":")
        try:
            low, high = int(lo), int(hi or lo)
        except ValueError:
            return None
        if high <= 1:
            return None
        if not 1 <= low <= high:
            raise InvalidOptionError(
                f"--nnodes {nnodes}: MIN:MAX needs 1 <= MIN <= MAX", "--nnodes")
        endpoint = str(getattr(ns, "rdzv_endpoint", "") or "")
        if not endpoint:
            addr, port = str(getattr(ns, "master_addr", "") or ""), getattr(ns, "master_port",
                                                                           None)
            if not addr or port is None:
                raise InvalidOptionError(
                    "resilient-strategy run --nnodes > 1 needs --rdzv-endpoint HOST:PORT (or "
                    "--master-addr and --master-port): the supervisors agree there before the "
                    "workers start", "--rdzv-endpoint")
            endpoint = f"{addr}:{port}"
        host, port_ = parse_rendezvous_endpoint(endpoint, default_port=29400)
        rdzv_id = str(getattr(ns, "rdzv_id", "") or "none")
        elastic = low != high
        return cls(node=int(getattr(ns, "node_rank", 0) or 0), nodes=high, nproc=nproc,
                   host=host, port=int(port_), run_id=rdzv_id, min_nodes=low,
                   floor=low if elastic else 1)

    def env(self, base: Mapping[str, str], attempt: int) -> dict[str, str]:
        """The variables `Job` reads, for this node's local
        rank 0 in launch attempt ``attempt`` (node 0 hosts the store: it is global rank 0)."""
        here = self.position
        return {
            **base, "WORLD_SIZE": str(len(self.present) * self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc), "RANK": str(here * self.nproc),
            "LOCAL_RANK": "0", "GROUP_RANK": str(here), "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port), "TORCHELASTIC_RUN_ID": f"run-{self.run_id}",
            "TORCHELASTIC_RESTART_COUNT": f"attempt{attempt}",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }

    def job(self, attempt: int) -> Job:
        """The job of ``attempt`` among its members (one node alone: the whole job's, with this
        node's identity, for the store's keys)."""
        job = Job.from_env(self.env({}, attempt))
        if job is None:  # one member: Job.from_env names no job of one node
            job = Job.from_env(replace(self, members=()).env({}, attempt))
        assert job is not None  # nodes > 1 and a port: always a job
        return job

    def roster(self, attempt: int) -> Job:
        """The job of the whole node set (every node by its --node-rank): where the membership
        round of ``attempt`` meets (`resilient_strategy.nodes.membership`)."""
        job = Job.from_env(replace(self, members=()).env({}, attempt))
        assert job is not None
        return replace(job, prefix=job.prefix + "members/")

    @property
    def where(self) -> str:
        return (f"{self.host}:{self.port} (keys under resilient_strategy/{KEY_VERSION}/"
                f"run-{self.run_id}/)")


class PeerWatch:
    """The other nodes' fault records of one attempt, and whether this node still reaches the
    job's store; never raises and never blocks the agent's monitoring loop.

    A thread of its own looks at the store every `PEER_POLL_S` on its own connection,
    each look bounded by `STORE_LOOK_S`; `poll` only reads what it saw. A node that
    has not reached the store for ``window_s`` (the heartbeat window) is cut off: `poll`
    returns a `CUT_OFF` record of this node's own, the agent stops its
    workers, and the supervisor stops with 75 (the others go on without it)."""

    def __init__(self, link: NodeLink, attempt: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic, *,
                 window_s: float = HEARTBEAT_STALE_S, look_s: float = STORE_LOOK_S,
                 opener: Callable[..., Any] | None = None) -> None:
        self.link, self.job, self.clock = link, link.job(attempt), clock
        #: where a node that comes back asks to join the next attempt (node 0 watches it while
        #: fewer than the most nodes run)
        self._next = (link.roster(attempt + 1).prefix
                      if link.node == 0 and len(link.present) < link.nodes else "")
        self._joining: tuple[int, ...] = ()
        self.timeout_s, self.window_s, self.look_s = timeout_s, window_s, look_s
        self._opener = opener or open_store
        self.store: Any = None  # the supervisor's connection, after the attempt
        self._lock = threading.Lock()
        self._seen: dict[int, PeerFault] = {}  # by node (--node-rank)
        self._contact = clock()  # the last time a look at the store was answered
        #: each other member's heartbeat in this attempt: node -> (count, when it last moved)
        self._beats: dict[int, tuple[int, float]] = {
            n: (0, self._contact) for n in link.present if n != link.node}
        #: the nodes whose verdict never came (`await_all`), by --node-rank
        self.missing: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="rs-peer-watch", daemon=True)
        self._thread.start()

    # --- the watching thread -------------------------------------------------------------
    def _watch(self) -> None:
        store: Any = None
        while not self._stop.is_set():
            try:
                if store is None:
                    store = self._opener(self.job, self.look_s, client=True)
                seen = self._look(store)
            except Exception:  # unreachable this time: the window decides, not one look
                seen, store = None, None  # a connection that timed out is not trusted again
            if seen is not None:
                with self._lock:
                    self._contact = self.clock()
                    self._seen.update(seen)
            self._stop.wait(PEER_POLL_S)

    def _look(self, store: Any) -> dict[int, PeerFault]:
        """Every node's record in the store, by --node-rank, after this node's heartbeat and a
        look at the others' (raises when the store does not answer)."""
        present = self.link.present
        beat = f"{self.job.prefix}beat/"
        store.add(beat + str(self.link.node), 1)
        counts = {n: int(store.add(beat + str(n), 0)) for n in self._beats}
        def read(place: int, record: dict[str, Any]) -> PeerFault:
            # a record refused (forged, malformed: an unknown cause or kind) is one logged line
            # naming its key, and no record: never a verdict, never a store out of reach
            node = present[place] if 0 <= place < len(present) else place
            return PeerFault.from_dict({**record, "node": node})

        out = {f.node: f for f in read_faults(store, self.job, read, strict=True).values()}
        joining = waiting(store, self._next, present, self.link.nodes) if self._next else ()
        now = self.clock()
        with self._lock:
            self._joining = joining
            for n, count in counts.items():
                if count != self._beats[n][0]:
                    self._beats[n] = (count, now)
        return out

    def _quiet(self, node: int) -> bool:
        """Whether ``node``'s heartbeat has not moved for the window while this node reached
        the store (never this node itself): nothing more will come from it."""
        with self._lock:
            beat = self._beats.get(node)
            return beat is not None and self._contact - beat[1] >= self.window_s

    def silent(self) -> PeerFault | None:
        """The first other node of this attempt whose heartbeat has not moved for the window
        while this node reached the store, and that left no record (a node that finished
        stops beating after its record): it vanished or is cut off. None when none."""
        with self._lock:
            contact = self._contact
            for n, (_, moved) in sorted(self._beats.items()):
                quiet = contact - moved
                if quiet >= self.window_s and n not in self._seen:
                    return PeerFault(n, "", Verdict(
                        VerdictKind.LOST, f"no heartbeat in the job's store for {quiet:.0f} s "
                        f"(the window is {self.window_s:g} s): its supervisor died or its link "
                        "is down", node=n))
        return None

    def close(self) -> None:
        """Stop the watching thread: it ends after the look it is in (bounded), on its own
        connection; nothing waits for it."""
        self._stop.set()
        self._thread.join(PEER_POLL_S)

    def reachable(self) -> bool:
        """Whether the store answered within the last two looks' time."""
        return self.unreachable_s() < 2 * (self.look_s + PEER_POLL_S)

    # --- what the agent and the supervisor read ------------------------------------------
    def unreachable_s(self) -> float:
        """Seconds since the store last answered this node."""
        with self._lock:
            return self.clock() - self._contact

    def cut_off(self) -> PeerFault | None:
        """This node's own record when it has not reached the store for the window, else None."""
        silent = self.unreachable_s()
        if silent < self.window_s:
            return None
        node = self.link.node
        return PeerFault(node, "", Verdict(
            VerdictKind.CUT_OFF, f"node {node} cannot reach the job's store at "
            f"{self.link.host}:{self.link.port} (no answer for {silent:.0f} s, more than the "
            f"heartbeat window of {self.window_s:g} s): this node is cut off from the others, "
            "which go on without it", node=node, where=f"node {node}"))

    def poll(self) -> PeerFault | None:
        """The first other node's fault record seen (a finished node's record is none), or this
        node's own cut-off record; None. Never blocks on the store."""
        with self._lock:
            fault = next((f for n, f in sorted(self._seen.items())
                          if n != self.link.node and not f.verdict.ok), None)
        if fault is not None:
            return fault
        own = self.cut_off()
        if own is not None:
            return own
        lost = self.silent()
        if lost is not None:
            return lost
        with self._lock:
            joining = self._joining
        if joining:  # a node came back: relaunch across the larger group (node 0's record)
            node = self.link.node
            return PeerFault(node, "", Verdict(
                VerdictKind.JOIN, f"node(s) {', '.join(map(str, joining))} asked to join: "
                "the job relaunches across the larger group from the last checkpoint",
                node=node))
        return None

    def _main_store(self) -> Any:
        if self.store is None:
            self.store = self._opener(self.job, self.look_s, client=True)
        return self.store

    def faults(self) -> list[PeerFault]:
        """Every node's fault record, by node (one look, bounded; [] when unreachable)."""
        try:
            seen = self._look(self._main_store())
        except Exception:
            self.store = None  # a connection that timed out is not trusted again
            return []
        with self._lock:
            self._contact = self.clock()
            self._seen.update(seen)
        return [seen[n] for n in sorted(seen)]

    def await_all(self, timeout_s: float) -> list[PeerFault]:
        """Every node's record of this attempt, waiting up to ``timeout_s`` for the missing
        ones (less when this node is cut off: nothing will come); a node whose record never
        comes is named as lost."""
        deadline = self.clock() + timeout_s
        present = self.link.present
        read = {f.node: f for f in self.faults()}  # kept: a record read stays read
        while (any(n not in read and not self._quiet(n) for n in present)
               and self.clock() < deadline and self.cut_off() is None):
            time.sleep(PEER_POLL_S / 5)
            read.update((f.node, f) for f in self.faults())
        faults = [read[n] for n in sorted(read)]
        seen = set(read)
        self.missing = tuple(n for n in present if n not in seen)
        step = max((f.verdict.step for f in faults), default=0)  # where the others were
        return faults + [PeerFault(n, "", Verdict(
            VerdictKind.LOST, f"node {n}'s supervisor gave no verdict within {timeout_s:g} s "
            "(it vanished)", step, node=n, where=f"node {n}")) for n in self.missing]

    def gone(self) -> dict[int, str]:
        """The nodes of this attempt known gone before the next membership round, and how:
        no verdict came (`resilient_strategy.nodes.membership.NO_VERDICT`), or its own
        record says it was cut off (`resilient_strategy.nodes.membership.CUT_OFF`)."""
        from ..nodes.membership import CUT_OFF, NO_VERDICT

        out = {n: NO_VERDICT for n in self.missing}
        with self._lock:
            for n, f in self._seen.items():
                if f.verdict.kind is VerdictKind.CUT_OFF and n != self.link.node:
                    out[n] = CUT_OFF
        return out

    def record(self, fault: PeerFault) -> None:
        """Tell the other nodes what this node saw: retried while the store may still answer
        (within the window), best effort after (they see their own fault or lose this node at
        the next agreement)."""
        deadline = self.clock() + self.window_s
        while True:
            try:
                record_fault(self._main_store(), self.job, fault.to_dict())
            except Exception:
                self.store = None
            else:
                with self._lock:
                    self._contact = self.clock()
                return
            if self.cut_off() is not None or self.clock() >= deadline:
                return
            time.sleep(PEER_POLL_S / 5)


def regroup(link: NodeLink, attempt: int, gone: Mapping[int, str], timeout_s: float,
            margin_s: float) -> tuple[NodeLink, Change]:
    """The membership round of ``attempt`` (`resilient_strategy.nodes.membership`): this
    node joins, node 0 waits for the last attempt's nodes (``gone``: those known gone, each
    given the heartbeat window) and publishes who is in; returns this node's link for the nodes
    of ``attempt`` and the change. `resilient_strategy.errors.NodeLostError` when this
    node was dropped, cannot reach the store within ``timeout_s``, or fewer nodes than the job
    may run with are left (``--nnodes MIN:MAX``: MIN; a fixed count: all at the start, node 0
    alone after)."""
    from ..errors import NodeLostError
    from ..nodes.membership import (
        REJOIN_WAIT_S,
        await_members,
        gather,
        join,
        publish_current,
        read_current,
    )
    from ..nodes.store import Channel

    window = 2 * margin_s  # as the agreement's join window: the nodes start a little apart
    store = open_store(link.roster(attempt), timeout_s, client=link.node != 0)
    base = f"resilient_strategy/{KEY_VERSION}/run-{link.run_id}/"
    back = False
    if attempt == 0 and link.node != 0:  # this supervisor's first round: is the job running?
        now = read_current(store, base)
        if now is not None and link.node not in now.members:
            attempt, back = now.attempt + 1, True  # it comes back: the job's next attempt
    roster = link.roster(attempt)
    ch = Channel(store, roster.prefix)
    join(ch, link.node)
    if link.node == 0:
        before = link.present if attempt > 0 else tuple(range(link.nodes))
        change = gather(ch, attempt, before, gone, window, link.nodes)
        publish_current(store, base, change)
    else:
        change = await_members(ch, link.node, REJOIN_WAIT_S if back
                               else window + margin_s + timeout_s, attempt=attempt,
                               confirm_s=window + margin_s)
    need = link.floor if attempt > 0 else link.min_nodes
    if len(change.members) < need:
        first = change.left[0] if change.left else (None, "deadline")
        raise NodeLostError(
            f"node {first[0]} did not join attempt {attempt + 1} within {window:g} s, and the "
            f"job needs {need} node(s) (--nnodes {link.min_nodes}:{link.nodes}); "
            f"{len(change.members)} joined ({', '.join(map(str, change.members))})",
            first[0], "deadline")
    return link.with_members(change.members), change


def nodes_words(changes: Sequence[Change]) -> str:
    """The nodes of each attempt, for the run's summary line ("" for a one-node run)."""
    if not changes:
        return ""
    return " Nodes per attempt: " + "; ".join(
        f"{c.attempt + 1}: {','.join(map(str, c.members))}" for c in changes) + "."
