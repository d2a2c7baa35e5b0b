"""``resilient-strategy run --nnodes N``: the supervisors of the nodes agree before any worker
starts, and relaunch together.

Each node's supervisor speaks for its node (its ``--node-rank``) in a TCPStore at the rendezvous
endpoint (``--rdzv-endpoint host:port``), reachable before torchrun's agent starts: node 0's
supervisor hosts it there (``multi_tenant``: torch's c10d rendezvous handler in the same process
then reuses the same server, the other nodes' handlers connect to it as clients); every other
node's supervisor connects as a client. The supervisors' keys live under
``resilient_strategy/v1/run-<rdzv id>/attempt<n>/`` (a prefix of their own on the rendezvous
store, apart from torch's rendezvous keys and the workers'), one prefix per launch attempt.

Per attempt: :func:`resilient_strategy.nodes.manynodes.agreed_decision` (node 0 plans and probes across
the nodes, the others check the decision against their facts; heartbeats, mismatches and lost
nodes handled there), with the candidates that failed mid-run excluded on every node. While the
workers run, each supervisor watches the store for the other nodes' fault records
(:func:`resilient_strategy.nodes.store.recorded_faults`) and stops its workers when one appears;
a node that saw the fault itself records it (:func:`resilient_strategy.nodes.store.record_fault`).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..nodes.store import KEY_VERSION, Job, open_store, record_fault, recorded_faults
from .verdicts import PeerFault, Verdict, VerdictKind

#: The least time between two looks at the store for other nodes' fault records.
PEER_POLL_S = 0.5


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
        """The variables :class:`~resilient_strategy.nodes.store.Job` reads, for this node's local
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
    """The other nodes' fault records of one attempt, looked at no more often than
    :data:`PEER_POLL_S`; never raises (a store gone quiet is the agent's or the next
    agreement's to find)."""

    def __init__(self, link: NodeLink, attempt: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.link, self.job, self.clock = link, link.job(attempt), clock
        self.store: Any = None
        self._next = 0.0
        with contextlib.suppress(Exception):
            self.store = open_store(self.job, timeout_s, client=True)

    def poll(self) -> PeerFault | None:
        """The first other node's fault record, or None."""
        now = self.clock()
        if self.store is None or now < self._next:
            return None
        self._next = now + PEER_POLL_S
        return next((f for f in self.faults() if f.node != self.link.node), None)

    def faults(self) -> list[PeerFault]:
        """Every node's fault record, by node (an unreadable one is a lost node's)."""
        out: list[PeerFault] = []
        if self.store is None:
            return out
        with contextlib.suppress(Exception):
            for node, record in sorted(recorded_faults(self.store, self.job).items()):
                try:
                    out.append(PeerFault.from_dict({**record, "node": node}))
                except ValueError as exc:
                    out.append(PeerFault(node, str(record.get("candidate", "")), Verdict(
                        VerdictKind.LOST, f"an unreadable fault record ({exc})", node=node)))
        return out

    def await_all(self, timeout_s: float) -> list[PeerFault]:
        """Every node's record of this attempt, waiting up to ``timeout_s`` for the missing
        ones; a node whose record never comes is named as lost."""
        if self.store is None:
            return []
        deadline = self.clock() + timeout_s
        read = {f.node: f for f in self.faults()}  # kept: a record read stays read
        while len(read) < self.link.nodes and self.clock() < deadline:
            time.sleep(PEER_POLL_S / 5)
            read.update((f.node, f) for f in self.faults())
        faults = [read[n] for n in sorted(read)]
        seen = set(read)
        return faults + [PeerFault(n, "", Verdict(
            VerdictKind.LOST, f"node {n}'s supervisor gave no verdict within {timeout_s:g} s "
            "(it vanished)", node=n, where=f"node {n}")) for n in range(self.link.nodes)
            if n not in seen]

    def record(self, fault: PeerFault) -> None:
        """Tell the other nodes what this node saw (best effort: they see their own fault or
        lose this node at the next agreement)."""
        if self.store is not None:
            with contextlib.suppress(Exception):
                record_fault(self.store, self.job, fault.to_dict())
