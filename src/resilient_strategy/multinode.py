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
or every node stops with :class:`NodeMismatchError`. A node that stops answering ends the
decision on every node with :class:`NodeLostError` within the deadlines; no decision file is
shared between nodes (the ranks of one node still share theirs, :mod:`.agreement`).

Remedies between nodes are measured, never guessed: after plain NCCL fails between nodes,
NCCL with ``NCCL_SOCKET_IFNAME`` set to the interface that routes to the rendezvous host on each
node (from the kernel's routing table, :func:`route_interface`; the value ``@route`` in a
candidate stands for it, so every node keeps the same candidate key), then NCCL over sockets
(``NCCL_IB_DISABLE=1 NCCL_NET=Socket``). A variable the user set is never overridden. When no
backend works between the nodes, the planner's estimate picks a slower backend across all
nodes, or node 0 alone with accumulation keeping the global batch (the other nodes exit 0).

The mid-run relaunch across nodes belongs to the supervisor (``resilient-strategy run``):
:func:`record_fault` / :func:`recorded_faults` are its hook: a node writes the fault it saw into
the store, every node's supervisor reads it before relaunching.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import re
import socket
import struct
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import MultiNodeError, NodeLostError, NodeMismatchError, ResilientStrategyError
from .probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec
from .rules import Rule

if TYPE_CHECKING:
    from .candidate import Candidate
    from .facts import Facts
    from .options import Options
    from .plan import Plan

log = logging.getLogger("resilient_strategy")
__all__ = ["Job", "MultiNodeError", "NodeLostError", "NodeMismatchError", "agreed_decision",
           "record_fault", "recorded_faults", "route_interface"]

#: A candidate's variable with this value means: the interface routing to the rendezvous host,
#: resolved on each node (:func:`node_values`).
ROUTE = "@route"
KEY_VERSION = "v1"
#: Slack on every wait between nodes, beyond the probe's own deadline (at least this many
#: seconds, or half the probe timeout): the nodes start, import and time out a little apart.
MARGIN_FLOOR_S = 10.0
#: Every node's decider beats this often; a node silent for HEARTBEAT_STALE_S is lost.
HEARTBEAT_S = 0.5
HEARTBEAT_STALE_S = 10.0
PROC_NET_ROUTE = Path("/proc/net/route")
_SIOCGIFADDR = 0x8915

Decided = tuple["Plan", dict[str, ProbeResult], bool, bool]
Prober = Callable[[ProbeSpec, Mapping[str, str]], ProbeResult]
#: (spec, env, job, key prefix, stop) -> this node's result; ``stop()`` gives a reason to give up
CrossProber = Callable[[ProbeSpec, Mapping[str, str], "Job", str, Callable[[], str]], ProbeResult]


# --------------------------------------------------------------------------------------------
# The job and its store
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Job:
    """This node's place in a multi-node launch, and where the job's store is."""

    node: int
    nodes: int
    local_world: int
    rank: int
    master_addr: str
    master_port: int
    agent_store: bool  # torchrun's agent hosts the store; else global rank 0 hosts it
    prefix: str

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Job | None:
        """The job from torchrun's variables; None when they do not describe a multi-node job
        with a store (then the nodes cannot talk, and plan from the rules alone)."""
        try:
            world = int(env.get("WORLD_SIZE", "1"))
            local = int(env.get("LOCAL_WORLD_SIZE", "0") or 0)
            rank = int(env.get("RANK", "0"))
            port = int(env.get("MASTER_PORT", ""))
        except ValueError:
            return None
        addr = env.get("MASTER_ADDR", "")
        if not addr or not 0 < local < world or world % local or not 0 < port < 65536:
            return None
        try:
            node = int(env.get("GROUP_RANK", str(rank // local)))
        except ValueError:
            node = rank // local
        run = env.get("TORCHELASTIC_RUN_ID", "none")
        restart = env.get("TORCHELASTIC_RESTART_COUNT", "0")
        return cls(
            node=node, nodes=world // local, local_world=local, rank=rank, master_addr=addr,
            master_port=port, agent_store=env.get("TORCHELASTIC_USE_AGENT_STORE") == "True",
            prefix=f"resilient_strategy/{KEY_VERSION}/{run}/{restart}/",
        )

    @property
    def store_text(self) -> str:
        who = "torchrun's agent store" if self.agent_store else "hosted by rank 0 (multi-tenant)"
        return f"{self.master_addr}:{self.master_port} ({who}, keys under {self.prefix})"


#: Stores this process hosts (non-agent launches): kept alive so that ``init_process_group``
#: on the same port reuses the server (``multi_tenant=True``) instead of failing to bind.
_HOSTED: list[Any] = []


def open_store(job: Job, timeout_s: float, *, client: bool = False) -> Any:
    """A TCPStore connection to the job's store (torch imported here, lazily); global rank 0
    hosts it when torchrun's agent does not (unless ``client``)."""
    try:
        import importlib

        dist: Any = importlib.import_module("torch.distributed")
    except ImportError as exc:
        raise MultiNodeError(f"a multi-node job needs torch.distributed to agree: {exc}") from exc
    host = not job.agent_store and job.rank == 0 and not client
    try:
        store = dist.TCPStore(
            job.master_addr, job.master_port, is_master=host,
            timeout=timedelta(seconds=timeout_s), wait_for_workers=False, multi_tenant=host,
        )
    except (RuntimeError, OSError, ValueError) as exc:
        raise NodeLostError(
            f"node {job.node} cannot reach the job's store at {job.store_text} within "
            f"{timeout_s:g} s: {_first_line(exc)}", how="store"
        ) from exc
    if host:
        _HOSTED.append(store)
    return store


class Channel:
    """JSON objects under the job's key prefix, each read with its own deadline.

    A wait for a node's answer also watches that node's heartbeat (:class:`Heartbeat`): a node
    whose decider stopped beating for :data:`HEARTBEAT_STALE_S` is lost at once, not at the end
    of the wait (a node merely busy in a hung probe still beats).
    """

    def __init__(self, store: Any, prefix: str, poll_s: float = 0.05) -> None:
        self.store = store
        self.prefix = prefix
        self.poll_s = poll_s
        self._beats: dict[int, tuple[int, float]] = {}  # node -> (last count, when it changed)

    def put(self, key: str, value: Mapping[str, Any]) -> None:
        try:
            self.store.set(self.prefix + key, json.dumps(value, allow_nan=False))
        except (RuntimeError, OSError) as exc:
            raise NodeLostError(f"the job's store stopped answering: {_first_line(exc)}",
                                how="store") from exc

    def take(self, key: str, timeout_s: float, missing: str, who: int | None = None
             ) -> dict[str, Any]:
        """The object at ``key`` once it is there; :class:`NodeLostError` after ``timeout_s``,
        or as soon as node ``who`` (the one to write it) stops beating."""
        full = self.prefix + key
        deadline = time.monotonic() + timeout_s
        try:
            while not self.store.check([full]):
                now = time.monotonic()
                if now >= deadline:
                    raise NodeLostError(
                        f"{missing} within {timeout_s:.3g} s; it may have died or hung: see its "
                        "log", who)
                if who is not None and self.stale(who, now):
                    raise NodeLostError(
                        f"{missing}: node {who} stopped beating (no heartbeat for "
                        f"{HEARTBEAT_STALE_S:g} s): its processes died or froze", who,
                        "heartbeat")
                time.sleep(self.poll_s)
            raw = self.store.get(full)
        except (RuntimeError, OSError) as exc:
            raise NodeLostError(
                f"{missing}: the job's store stopped answering ({_first_line(exc)}); the node "
                "that hosts it may have died: see its log", how="store"
            ) from exc
        try:
            data = json.loads(bytes(raw).decode("utf-8"))
        except ValueError as exc:
            raise MultiNodeError(f"unreadable value at {full!r} in the job's store: {exc}") from exc
        if not isinstance(data, dict):
            raise MultiNodeError(f"unreadable value at {full!r} in the job's store")
        return data

    def stale(self, node: int, now: float) -> bool:
        """Whether ``node``'s heartbeat has not moved for :data:`HEARTBEAT_STALE_S`."""
        count = int(self.store.add(f"{self.prefix}alive/{node}", 0))
        last = self._beats.get(node)
        if last is None or last[0] != count:
            self._beats[node] = (count, now)
            return False
        return count > 0 and now - last[1] > HEARTBEAT_STALE_S  # 0: not started yet


class Heartbeat:
    """A daemon thread that counts up ``alive/<node>`` in the store while this node decides
    (its own store connection: the deciding thread's may be busy)."""

    def __init__(self, store: Any, prefix: str, node: int) -> None:
        self._store, self._key = store, f"{prefix}alive/{node}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rs-heartbeat", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(HEARTBEAT_S * 4)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._store.add(self._key, 1)
            except (RuntimeError, OSError):
                return  # the store is gone: the deciding thread finds out on its next call
            self._stop.wait(HEARTBEAT_S)


def record_fault(store: Any, job: Job, fault: Mapping[str, Any]) -> None:
    """Supervisor hook: this node saw a backend fault mid-run; every node's supervisor reads it
    (:func:`recorded_faults`), stops its workers and relaunches on the next candidate."""
    Channel(store, job.prefix).put(f"fault/{job.node}", {**fault, "node": job.node})


def recorded_faults(store: Any, job: Job) -> dict[int, dict[str, Any]]:
    """The faults the nodes recorded (:func:`record_fault`), by node; never waits."""
    out: dict[int, dict[str, Any]] = {}
    ch = Channel(store, job.prefix)
    for k in range(job.nodes):
        with contextlib.suppress(RuntimeError, OSError):
            if store.check([ch.prefix + f"fault/{k}"]):
                out[k] = ch.take(f"fault/{k}", 1.0, f"node {k}'s fault record")
    return out


# --------------------------------------------------------------------------------------------
# The interface that routes to the rendezvous host
# --------------------------------------------------------------------------------------------
def route_interface(
    dest: str, routes: str, local_addresses: Mapping[str, str]
) -> tuple[str | None, str]:
    """The interface this host uses to reach IPv4 address ``dest``, and how it was found. Pure.

    A loopback address: the loopback interface (the whole job is on this host). An address of
    this host: the interface that holds it (the other nodes reach this one there; the kernel
    would say ``lo``, which NCCL could not offer them). Else the longest-prefix match of the
    kernel's main routing table (``routes``: the text of /proc/net/route), lowest metric first.
    """
    try:
        ip = ipaddress.ip_address(dest)
    except ValueError:
        return None, f"{dest!r} is not an IP address"
    if ip.version != 4:
        return None, f"{dest} is IPv6; only IPv4 routes are read"
    if ip.is_loopback:
        lo = next((n for n, a in local_addresses.items()
                   if ipaddress.ip_address(a).is_loopback), "lo")
        return lo, f"{dest} is a loopback address: every node is on this host"
    for name, addr in local_addresses.items():
        if addr == dest:
            return name, f"{dest} is this host's own address on {name}"
    want = struct.unpack("=I", socket.inet_aton(dest))[0]  # /proc/net/route's byte order
    best: tuple[int, int, str, str] | None = None
    for line in routes.splitlines()[1:]:
        f = line.split()
        if len(f) < 8:
            continue
        try:
            dst, flags, metric, mask = int(f[1], 16), int(f[3], 16), int(f[6]), int(f[7], 16)
        except ValueError:
            continue
        if not flags & 0x1 or want & mask != dst:  # RTF_UP
            continue
        bits = bin(mask).count("1")
        if best is None or (bits, -metric) > (best[0], best[1]):
            net = socket.inet_ntoa(struct.pack("=I", dst))
            best = (bits, -metric, f[0], f"kernel route {net}/{bits} dev {f[0]} (/proc/net/route)")
    if best is None:
        return None, f"no route to {dest} in /proc/net/route"
    return best[2], best[3]


def local_addresses() -> dict[str, str]:
    """Each interface's (first) IPv4 address, read with SIOCGIFADDR; {} where that fails."""
    out: dict[str, str] = {}
    try:
        import fcntl

        names = [n for _, n in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                with contextlib.suppress(OSError):
                    packed = fcntl.ioctl(s.fileno(), _SIOCGIFADDR,
                                         struct.pack("256s", name.encode()[:15]))
                    out[name] = socket.inet_ntoa(packed[20:24])
    except (ImportError, OSError, AttributeError):
        pass
    return out


def route_to_master(env: Mapping[str, str]) -> tuple[str | None, str]:
    """The interface routing to ``MASTER_ADDR`` here, and how it was found."""
    host = env.get("MASTER_ADDR", "")
    if not host:
        return None, "MASTER_ADDR is not set"
    try:
        dest = socket.getaddrinfo(host, None, socket.AF_INET)[0][4][0]
    except (OSError, IndexError) as exc:
        return None, f"cannot resolve MASTER_ADDR={host}: {exc}"
    try:
        routes = PROC_NET_ROUTE.read_text(encoding="utf-8")
    except OSError:
        routes = ""
    iface, how = route_interface(str(dest), routes, local_addresses())
    return iface, (how if dest == host else f"MASTER_ADDR={host} is {dest}; {how}")


def node_values(values: Mapping[str, str], env: Mapping[str, str]) -> dict[str, str]:
    """``values`` with :data:`ROUTE` resolved to this node's interface routing to the master
    (dropped, with a warning, when there is none)."""
    out = dict(values)
    for name, value in values.items():
        if value == ROUTE:
            iface, how = route_to_master(env)
            if iface:
                out[name] = iface
            else:
                del out[name]
                log.warning("resilient_strategy: %s not set: %s", name, how)
    return out


def remedy_rules() -> tuple[Rule, ...]:
    """NCCL remedies between nodes, tried (and measured) after plain NCCL fails between them."""
    src = ("NCCL environment variables (docs.nvidia.com/deeplearning/nccl/user-guide/docs/env.html);"
           " ray-project/ray#30333 (a guessed NCCL_SOCKET_IFNAME default broke other clusters)")
    return (
        Rule(id="multinode-socket-ifname", when=(), effect="remedy", framework="torch",
             message="NCCL's bootstrap and sockets on the interface that routes to the rendezvous "
             "host: NCCL's own pick may not reach the other nodes and then hangs",
             source=src, env=(("NCCL_SOCKET_IFNAME", ROUTE),), origin="multinode"),
        Rule(id="multinode-socket-transport", when=(), effect="remedy", framework="torch",
             message="NCCL over TCP sockets on the routed interface, InfiniBand and network "
             "plugins off: a misconfigured InfiniBand or EFA fabric fails or hangs NCCL",
             source=src, origin="multinode",
             env=(("NCCL_IB_DISABLE", "1"), ("NCCL_NET", "Socket"),
                  ("NCCL_SOCKET_IFNAME", ROUTE))),
    )


# --------------------------------------------------------------------------------------------
# The cross-node probe: one process per node
# --------------------------------------------------------------------------------------------
def run_cross_probe(
    spec: ProbeSpec, env: Mapping[str, str], job: Job, key_prefix: str,
    stop: Callable[[], str] | None = None, *, python: str = sys.executable,
) -> ProbeResult:
    """This node's process of the probe group spanning all nodes (rank = node rank), meeting in
    the job's store under ``key_prefix``, within ``spec.timeout_s`` (or until ``stop()`` gives a
    reason: a peer node was lost); never raises for a failure."""
    from . import _proc
    from .prober import WORKER_TIMEOUT_MARGIN_S, worker_env

    cross = replace(spec, world_size=job.nodes)
    device = [str(spec.devices[0])] if spec.devices else []
    with tempfile.TemporaryDirectory(prefix="rs-xprobe-", ignore_cleanup_errors=True) as tmp:
        report = str(Path(tmp) / "report.json")
        argv = [
            python, "-m", "resilient_strategy.probes.torch_worker",
            "--backend", spec.backend, "--message-bytes", str(spec.message_bytes),
            "--parent-pid", str(os.getpid()), "--rank", str(job.node),
            "--world-size", str(job.nodes),
            # the worker takes devices[rank]: this node's one GPU at every rank's position
            "--devices", ",".join(device * job.nodes),
            "--store", f"{job.master_addr}:{job.master_port}", "--store-prefix", key_prefix,
            "--timeout", f"{spec.timeout_s + WORKER_TIMEOUT_MARGIN_S:g}", "--report", report,
        ]
        if not spec.train_step:
            argv.append("--no-train-step")
        cmd = _proc.WorkerCommand(argv=tuple(argv), env=worker_env(cross, env), cwd=tmp,
                                  report_path=report)
        try:
            group = _proc.run_group([cmd], spec.timeout_s, stop=stop)
        except OSError as exc:
            return ProbeResult(spec.candidate, ERROR, cause="worker_error",
                               detail=f"could not start the probe worker {python!r}: {exc}")
    from .probe import parse_probe

    if group.stopped:
        return ProbeResult(spec.candidate, ERROR, round(group.elapsed_s, 3), "inter_node",
                           f"stopped: {group.stopped}")

    return parse_probe(cross, group.outcomes, group.elapsed_s, group.timed_out)


def combine(spec: ProbeSpec, nodes: Sequence[Mapping[str, Any]], job: Job) -> ProbeResult:
    """One result for a candidate from every node's round report. Pure.

    A failed local group is that node's failure (its cause kept: local remedies apply); else a
    failure between nodes is cause ``inter_node`` (the node's own cause in the detail); else OK
    with the slowest bus (local or between nodes) and the slowest step.
    """
    elapsed = max((_elapsed(n) for n in nodes), default=0.0)
    world = job.nodes * job.local_world
    for n in nodes:
        local = _result(n.get("local"))
        if local is not None and not local.ok:
            return replace(local, candidate=spec.candidate, elapsed_s=round(elapsed, 3),
                           ranks=world, detail=f"node {n.get('node')}'s local group: {local.detail}",
                           extra=(("nodes", str(job.nodes)), ("failed_on", "local")))
    crosses = [(n.get("node"), _result(n.get("cross"))) for n in nodes]
    failed = [(k, r) for k, r in crosses if r is None or not r.ok]
    if failed:
        return _blame(spec, failed, job, round(elapsed, 3))
    locals_ = [lr for n in nodes if (lr := _result(n.get("local"))) is not None]
    oks = [cr for _, cr in crosses if cr is not None]
    cross_bw = [r.bus_bandwidth_gbps for r in oks if r.bus_bandwidth_gbps]
    local_bw = [r.bus_bandwidth_gbps for r in locals_ if r.bus_bandwidth_gbps]
    steps = [r.step_seconds for r in [*oks, *locals_] if r.step_seconds]
    extra = [("nodes", str(job.nodes))]
    if cross_bw:
        extra.append(("inter_node_bus_gbps", f"{min(cross_bw):g}"))
    if local_bw:
        extra.append(("local_bus_gbps", f"{min(local_bw):g}"))
    for n in nodes:
        if n.get("route"):
            extra.append((f"route/{n.get('node')}", str(n["route"])))
    bus = min([*cross_bw, *local_bw]) if cross_bw or local_bw else None
    detail = f"across {job.nodes} nodes: {oks[0].detail}" if oks else ""
    return ProbeResult(
        spec.candidate, OK, round(elapsed, 3), detail=detail, bus_bandwidth_gbps=bus,
        message_bytes=oks[0].message_bytes if oks else None,
        step_seconds=max(steps) if steps else None, ranks=world, extra=tuple(extra),
    )


#: What a worker says when its peer on another node went away (killed at its deadline, or
#: died): an echo of that node's failure, not a cause of its own.
_ECHO = re.compile(r"Connection (?:closed|reset) by peer|Broken pipe|ncclRemoteError|"
                   r"remote process exited|peer closed", re.I)


def _blame(spec: ProbeSpec, failed: Sequence[tuple[Any, ProbeResult | None]], job: Job,
           elapsed: float) -> ProbeResult:
    """The failure between nodes, blamed in order: a node that never joined; a node that said
    what went wrong; the nodes that hung (stopping a hung worker closes its links, so its peers'
    "connection closed by peer" is an echo); only then such an echo."""
    extra = (("nodes", str(job.nodes)), ("failed_on", "inter_node"))
    world = job.nodes * job.local_world
    absent = [k for k, r in failed if r is None]
    if absent:
        return ProbeResult(spec.candidate, ERROR, elapsed, "inter_node",
                           f"node {absent[0]} did not join the probe between nodes", ranks=world,
                           extra=extra)
    results = [(k, r) for k, r in failed if r is not None]
    hung = [k for k, r in results if r.status == TIMEOUT]
    echoes = [k for k, r in results if r.status != TIMEOUT and _ECHO.search(r.why())]
    told = [(k, r) for k, r in results if k not in hung and k not in echoes]
    if told:
        k, bad = told[0]
        return ProbeResult(spec.candidate, ERROR, elapsed, "inter_node", f"node {k}: {bad.why()}",
                           stderr_tail=bad.stderr_tail, ranks=world,
                           extra=(*extra, ("node_cause", bad.cause)))
    if hung:
        seen = f"; node(s) {echoes} saw the link close when it was stopped" if echoes else ""
        tails = "\n".join(r.stderr_tail for _, r in results)[-4000:]
        return ProbeResult(
            spec.candidate, TIMEOUT, elapsed, "inter_node",
            f"node(s) {hung} did not finish the collective between nodes within "
            f"{spec.timeout_s:g} s (one hung, or waited for a peer that hung){seen}",
            stderr_tail=tails, ranks=world, extra=(*extra, ("node_cause", "timeout")))
    k, bad = results[0]
    return ProbeResult(spec.candidate, ERROR, elapsed, "inter_node", f"node {k}: {bad.why()}",
                       stderr_tail=bad.stderr_tail, ranks=world,
                       extra=(*extra, ("node_cause", bad.cause)))


def _result(d: Any) -> ProbeResult | None:
    if d is None:
        return None
    try:
        return ProbeResult.from_dict(d)
    except ValueError as exc:
        raise MultiNodeError(f"a node sent a probe result this node cannot read: {exc}; run "
                             "the same version of resilient_strategy on every node") from exc


def _elapsed(n: Mapping[str, Any]) -> float:
    v = n.get("elapsed_s", 0.0)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else 0.0


def spec_to_dict(spec: ProbeSpec) -> dict[str, Any]:
    return asdict(spec)


def spec_from_dict(d: Mapping[str, Any]) -> ProbeSpec:
    try:
        return ProbeSpec(
            candidate=str(d["candidate"]), framework=str(d["framework"]),
            backend=str(d["backend"]), devices=tuple(int(x) for x in d["devices"]),
            env=tuple((str(k), str(v)) for k, v in d["env"]),
            world_size=int(d["world_size"]), timeout_s=float(d["timeout_s"]),
            message_bytes=int(d["message_bytes"]), train_step=bool(d["train_step"]),
            logical_cpus=int(d.get("logical_cpus", 0)),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise MultiNodeError(f"node 0 sent a probe this node cannot read ({exc}); run the same "
                             "version of resilient_strategy on every node") from exc


# --------------------------------------------------------------------------------------------
# The agreement
# --------------------------------------------------------------------------------------------
def node_summary(facts: Facts, framework: str, job: Job, env: Mapping[str, str]) -> dict[str, Any]:
    """What a node tells the others about itself (shown in every node's trace)."""
    info = facts.framework(framework)
    iface, how = route_to_master(env)
    return {
        "node": job.node, "host": socket.gethostname(), "gpus": len(facts.gpus),
        "gpu_names": sorted({g.name for g in facts.gpus}), "version": info.version,
        "cuda": info.cuda, "nccl": info.nccl, "route": iface, "route_how": how,
    }


def contradictions(
    facts: Facts, framework: str, chosen: Candidate | None, leader: Mapping[str, Any]
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
        elif isinstance(leader.get("gpus"), int) and leader["gpus"] != n:
            out.append(f"node 0 sees {leader['gpus']} GPU(s) and this node {n}: node 0's "
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
    summary: dict[str, Any] = field(default_factory=dict)
    rounds: int = 0

    def others(self) -> list[int]:
        return [k for k in range(self.job.nodes) if k != self.job.node]

    def lost_peer(self) -> str:
        """Why the probe across nodes is pointless now (a node stopped beating), or ""."""
        now = time.monotonic()
        try:
            lost = [k for k in self.others() if self.channel.stale(k, now)]
        except (RuntimeError, OSError) as exc:
            return f"the job's store stopped answering ({_first_line(exc)})"
        return f"node(s) {lost} stopped beating" if lost else ""

    def run_round(self, n: int, spec: ProbeSpec) -> dict[str, Any]:
        """This node's part of round ``n``: its local group, then the group across nodes."""
        t0 = time.monotonic()
        here = replace(spec, env=tuple(node_values(dict(spec.env), self.env).items()))
        local = None
        if self.job.local_world > 1 and spec.backend in ("nccl", "gloo"):
            local = self.local_prober(replace(here, world_size=self.job.local_world), self.env)
        mine_ok = local is None or local.ok
        self.channel.put(f"r{n}/local/{self.job.node}", {"ok": mine_ok})
        peers_ok = all(
            self.channel.take(f"r{n}/local/{k}", spec.timeout_s + self.margin_s,
                              f"node {k} did not finish its local probe of round {n}",
                              who=k)["ok"]
            for k in self.others()
        )
        cross = None
        if mine_ok and peers_ok:
            cross = self.cross_prober(here, self.env, self.job, f"{self.job.prefix}r{n}/pg/",
                                      self.lost_peer)
        out = {
            "node": self.job.node, "local": local.to_dict() if local else None,
            "cross": cross.to_dict() if cross else None, "route": self.summary.get("route"),
            "elapsed_s": round(time.monotonic() - t0, 3),
        }
        self.channel.put(f"r{n}/result/{self.job.node}", out)
        return out

    # ----- node 0 ------------------------------------------------------------------------------
    def lead(self, decide: Callable[..., Any], clock: Callable[[], float]) -> tuple[Decided, dict[str, Any]]:
        join = 2 * self.margin_s  # the nodes start together (after torchrun's rendezvous)
        nodes = {0: self.summary}
        for k in self.others():
            nodes[k] = self.channel.take(f"hello/{k}", join, f"node {k} did not join", who=k)

        def across(spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
            self.rounds += 1
            n = self.rounds
            self.channel.put(f"round/{n}", {"kind": "probe", "spec": spec_to_dict(spec)})
            reports = [self.run_round(n, spec)] + [
                self.channel.take(f"r{n}/result/{k}", spec.timeout_s + self.margin_s,
                                  f"node {k} sent no result for its probe of {spec.candidate}",
                                  who=k)
                for k in self.others()
            ]
            return combine(spec, reports, self.job)

        d = decide(self.facts, self.opts, self.env, across, clock, cross_node=True)
        p, results, proven = d.plan, dict(d.results), bool(d.proven)
        payload = {
            "kind": "decision", "chosen": p.chosen.key if p.chosen else None,
            "results": {k: v.to_dict() for k, v in results.items()}, "proven": proven,
            "nodes": {str(k): v for k, v in nodes.items()},
        }
        self.channel.put(f"round/{self.rounds + 1}", payload)
        bad: dict[int, str] = {}
        for k in self.others():
            try:
                ack = self.channel.take(f"ack/{k}", self.margin_s, f"node {k} did not confirm",
                                        who=k)
            except NodeLostError as exc:
                self.channel.put("verdict", {"ok": False, "node": k, "why": str(exc),
                                             "lost": True})
                raise
            if not ack.get("ok"):
                bad[k] = str(ack.get("why", ""))
        self.channel.put("verdict", {"ok": not bad, "node": min(bad) if bad else None,
                                     "why": "; ".join(f"node {k}: {w}" for k, w in bad.items())})
        if bad:
            raise NodeMismatchError(
                "the nodes disagree, so no node trains: " + "; ".join(
                    f"node {k}: {w}" for k, w in sorted(bad.items())))
        return (p, results, False, proven), payload

    def abort(self, why: str) -> None:
        """Node 0 failed: tell the others now rather than let them wait out their deadlines."""
        with contextlib.suppress(MultiNodeError, RuntimeError, OSError):
            if self.channel.store.check([self.channel.prefix + "verdict"]):
                return  # the others already have the verdict (a mismatch, or a lost node)
            self.channel.put(f"round/{self.rounds + 1}", {"kind": "abort", "why": why})
            self.channel.put("verdict", {"ok": False, "node": 0, "why": why, "lost": True})

    # ----- every other node --------------------------------------------------------------------
    def follow(self) -> tuple[Decided, dict[str, Any]]:
        wait = self.opts.timeout_s + 2 * self.margin_s
        for n in range(1, 64):
            msg = self.channel.take(f"round/{n}", wait + (self.opts.timeout_s if n == 1 else 0),
                                    "node 0 sent neither a probe nor its decision", who=0)
            if msg.get("kind") == "probe":
                self.run_round(n, spec_from_dict(msg.get("spec", {})))
                continue
            if msg.get("kind") == "abort":
                raise MultiNodeError(f"node 0 stopped the decision: {msg.get('why', '')}")
            return self.accept(msg), msg
        raise MultiNodeError("node 0 asked for more probes than a decision can need")

    def accept(self, payload: Mapping[str, Any]) -> Decided:
        results = _results(payload)
        proven = bool(payload.get("proven"))
        p = _replan(self.facts, self.opts, results, proven)
        leader = payload.get("nodes", {}).get("0", {}) if isinstance(payload.get("nodes"), dict) \
            else {}
        problems = contradictions(self.facts, self.opts.framework, p.chosen, leader)
        mine = p.chosen.key if p.chosen else None
        if mine != payload.get("chosen") and not problems:
            problems.append(f"from node 0's results this node plans {mine}, not node 0's "
                            f"{payload.get('chosen')}: the nodes see different machines or options")
        self.channel.put(f"ack/{self.job.node}", {"ok": not problems, "why": "; ".join(problems)})
        verdict = self.channel.take("verdict", 2 * self.margin_s, "node 0 gave no verdict",
                                    who=0)
        if problems:
            raise NodeMismatchError(
                f"node {self.job.node} cannot run node 0's decision ({payload.get('chosen')}): "
                + "; ".join(problems) + ". Every node stops.")
        if not verdict.get("ok"):
            kind = NodeLostError if verdict.get("lost") else NodeMismatchError
            raise kind(f"no node trains: {verdict.get('why', '')}")
        return p, results, False, proven


def _results(payload: Mapping[str, Any]) -> dict[str, ProbeResult]:
    raw = payload.get("results", {})
    if not isinstance(raw, dict):
        raise MultiNodeError("node 0's decision has no readable results")
    return {str(k): r for k, v in raw.items() if (r := _result(v)) is not None}


def _replan(facts: Facts, opts: Options, results: Mapping[str, ProbeResult], proven: bool) -> Plan:
    from .plan import plan

    p = plan(facts, opts.rules, results, opts)
    if p.next_probe is not None and not proven:
        p = replace(p, chosen=p.next_probe, next_probe=None)
    return p


def multinode_options(opts: Options, facts: Facts) -> Options:
    """``opts`` with the remedies between nodes (only where NCCL could run: a GPU build)."""
    if not facts.gpus or not facts.framework(opts.framework).cuda:
        return opts
    return replace(opts, rules=(*opts.rules, *remedy_rules()))


def trace_lines(job: Job, payload: Mapping[str, Any], p: Plan) -> list[str]:
    """What every node's trace says about the decision between nodes."""
    lines = [f"Node {job.node} of {job.nodes}: the nodes agreed through the job's store at "
             f"{job.store_text}; node 0 decided, every node checked it against its own facts."]
    nodes = payload.get("nodes", {})
    if isinstance(nodes, dict):
        for k in sorted(nodes, key=lambda x: int(x) if str(x).isdigit() else 0):
            n = nodes[k]
            if isinstance(n, dict):
                lines.append(
                    f"Node {k} ({n.get('host')}): {n.get('gpus')} GPU(s), torch {n.get('version')}"
                    f"; route to the rendezvous host: {n.get('route') or 'none'} "
                    f"({n.get('route_how')}).")
    results = _results(payload)
    across = [(k, r) for k, r in results.items() if ("nodes", str(job.nodes)) in r.extra]
    if across:
        lines.append(f"Probed across {job.nodes} nodes: " + "; ".join(
            f"{k}: {'ok' if r.ok else r.status} ({r.why() if not r.ok else r.detail})"
            for k, r in across) + ".")
    elif payload.get("proven"):
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
    *, cross_prober: CrossProber = run_cross_probe,
) -> Decided:
    """The decision of a multi-node job, the same on every rank of every node (see the module's
    docstring). ``decide``: the executor's, passed in (this module imports no executor)."""
    job = Job.from_env(env)
    if job is None:  # no store named: the nodes cannot talk, each plans from the rules alone
        d = decide(facts, opts, env, prober, clock)
        return d.plan, dict(d.results), bool(d.from_cache), bool(d.proven)
    opts = multinode_options(opts, facts)
    from .agreement import Agreement

    local = Agreement.for_job(env, facts.fingerprint(), opts.cache_dir)
    margin = max(MARGIN_FLOOR_S, opts.timeout_s / 2)
    if opts.launch.local_rank != 0:
        return _follow_local(facts, opts, local, opts.budget_s + 4 * opts.timeout_s + 6 * margin)
    node: _Node | None = None
    try:
        store = open_store(job, opts.timeout_s + margin)
        node = _Node(job, Channel(store, job.prefix), facts, opts, env, prober, cross_prober,
                     margin)
        node.summary = node_summary(facts, opts.framework, job, env)
        with Heartbeat(open_store(job, opts.timeout_s + margin, client=True), job.prefix,
                       job.node):
            if job.node == 0:
                decided, payload = node.lead(decide, clock)
            else:
                node.channel.put(f"hello/{job.node}", node.summary)
                decided, payload = node.follow()
    except ResilientStrategyError as exc:
        if node is not None and job.node == 0:
            node.abort(str(exc))
        with contextlib.suppress(ResilientStrategyError):
            local.publish({"chosen": None, "results": {}, "proven": False, "from_cache": False,
                           "error": str(exc)})
        raise
    p, results, from_cache, proven = decided
    lines = trace_lines(job, payload, p)
    if job.node != 0 and p.chosen is not None and p.chosen.num_replicas == 1:
        log.warning("resilient_strategy: node %d: no backend between the nodes beats node 0 "
                    "alone, so node 0 trains alone (%s); this node's ranks exit 0 at scope() "
                    "/ prepare().", job.node, p.chosen.label)
    p = _with_notes(p, lines)
    if job.local_world > 1:
        local.publish({"chosen": p.chosen.key if p.chosen else None,
                       "results": {k: v.to_dict() for k, v in results.items()},
                       "from_cache": from_cache, "proven": proven, "multinode_trace": lines})
    return p, results, from_cache, proven


def _follow_local(facts: Facts, opts: Options, agreement: Any, timeout_s: float) -> Decided:
    """A local rank other than 0: take the decision its node's local rank 0 published."""
    payload = agreement.wait(timeout_s)
    if payload.get("error"):
        raise MultiNodeError(f"local rank 0 of this node stopped: {payload['error']}")
    results = _results(payload)
    proven = bool(payload.get("proven"))
    p = _replan(facts, opts, results, proven)
    if (p.chosen.key if p.chosen else None) != payload.get("chosen"):
        raise MultiNodeError(
            f"this rank planned {p.chosen.key if p.chosen else None} but local rank 0 chose "
            f"{payload.get('chosen')}: pass the same arguments on every rank")
    extra = payload.get("multinode_trace", [])
    lines = [str(x) for x in extra] if isinstance(extra, list) else []
    return _with_notes(p, lines), results, bool(payload.get("from_cache")), proven


def _with_notes(p: Plan, lines: Sequence[str]) -> Plan:
    """``p`` with ``lines`` added to its trace (as ``multi_node`` notes)."""
    from .trace import Note

    return replace(p, events=(*p.events, *(Note("multi_node", line) for line in lines)))


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
