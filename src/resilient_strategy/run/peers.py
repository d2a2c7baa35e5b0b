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
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..nodes.store import (
    HEARTBEAT_STALE_S,
    KEY_VERSION,
    Job,
    open_store,
    record_fault,
    recorded_faults,
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

    node: int
    nodes: int
    nproc: int
    host: str
    port: int
    run_id: str

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
        if low != high:
            raise InvalidOptionError(
                f"resilient-strategy run needs a fixed node count (--nnodes {high}), not the "
                f"elastic range {nnodes}: the decision is made for a known set of nodes",
                "--nnodes")
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
        return cls(node=int(getattr(ns, "node_rank", 0) or 0), nodes=high, nproc=nproc,
                   host=host, port=int(port_), run_id=rdzv_id)

    def env(self, base: Mapping[str, str], attempt: int) -> dict[str, str]:
        """The variables `Job` reads, for this node's local
        rank 0 in launch attempt ``attempt`` (node 0 hosts the store: it is global rank 0)."""
        return {
            **base, "WORLD_SIZE": str(self.nodes * self.nproc),
            "LOCAL_WORLD_SIZE": str(self.nproc), "RANK": str(self.node * self.nproc),
            "LOCAL_RANK": "0", "GROUP_RANK": str(self.node), "MASTER_ADDR": self.host,
            "MASTER_PORT": str(self.port), "TORCHELASTIC_RUN_ID": f"run-{self.run_id}",
            "TORCHELASTIC_RESTART_COUNT": f"attempt{attempt}",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
        }

    def job(self, attempt: int) -> Job:
        job = Job.from_env(self.env({}, attempt))
        assert job is not None  # nodes > 1 and a port: always a job
        return job

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
        self.timeout_s, self.window_s, self.look_s = timeout_s, window_s, look_s
        self._opener = opener or open_store
        self.store: Any = None  # the supervisor's connection, after the attempt
        self._lock = threading.Lock()
        self._seen: dict[int, PeerFault] = {}
        self._contact = clock()  # the last time a look at the store was answered
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
        """Every node's record in the store (raises when the store does not answer)."""
        out: dict[int, PeerFault] = {}
        for node, record in sorted(recorded_faults(store, self.job, strict=True).items()):
            try:
                out[node] = PeerFault.from_dict({**record, "node": node})
            except ValueError as exc:
                out[node] = PeerFault(node, str(record.get("candidate", "")), Verdict(
                    VerdictKind.LOST, f"an unreadable fault record ({exc})", node=node))
        return out

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
        return fault if fault is not None else self.cut_off()

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
        read = {f.node: f for f in self.faults()}  # kept: a record read stays read
        while (len(read) < self.link.nodes and self.clock() < deadline
               and self.cut_off() is None):
            time.sleep(PEER_POLL_S / 5)
            read.update((f.node, f) for f in self.faults())
        faults = [read[n] for n in sorted(read)]
        seen = set(read)
        return faults + [PeerFault(n, "", Verdict(
            VerdictKind.LOST, f"node {n}'s supervisor gave no verdict within {timeout_s:g} s "
            "(it vanished)", node=n, where=f"node {n}")) for n in range(self.link.nodes)
            if n not in seen]

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
