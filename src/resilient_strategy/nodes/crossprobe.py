"""The cross-node probe: one process per node joins a probe group spanning all nodes (through the
job's store) and runs the checked all-reduce, the bandwidth measurement and a DDP step under the
probe's deadline; node 0 combines the nodes' results and blames the node that failed first
(an echo of another node's failure is not a cause of its own).
"""

from __future__ import annotations

import logging
import os
import re
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.measures.probe import ERROR, OK, TIMEOUT, ProbeResult, ProbeSpec

if TYPE_CHECKING:
    pass

from .messages import RoundReport
from .store import Job

log = logging.getLogger("resilient_strategy")

Prober = Callable[[ProbeSpec, Mapping[str, str]], ProbeResult]
#: (spec, env, job, key prefix, stop) -> this node's result; ``stop()`` gives a reason to give up
CrossProber = Callable[[ProbeSpec, Mapping[str, str], "Job", str, Callable[[], str]], ProbeResult]

def run_cross_probe(
    spec: ProbeSpec, env: Mapping[str, str], job: Job, key_prefix: str,
    stop: Callable[[], str] | None = None, *, python: str = sys.executable,
) -> ProbeResult:
    """This node's process of the probe group spanning all nodes (rank = node rank), meeting in
    the job's store under ``key_prefix``, within ``spec.timeout_s`` (or until ``stop()`` gives a
    reason: a peer node was lost); never raises for a failure."""
    from ..probing import proc
    from ..probing.prober import WORKER_TIMEOUT_MARGIN_S, worker_env

    cross = replace(spec, world_size=job.nodes)
    device = [str(spec.devices[0])] if spec.devices else []
    with tempfile.TemporaryDirectory(prefix="rs-xprobe-", ignore_cleanup_errors=True) as tmp:
        report = str(Path(tmp) / "report.json")
        argv = [
            python, "-m", "resilient_strategy.probing.workers.torch_worker",
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
        cmd = proc.WorkerCommand(argv=tuple(argv), env=worker_env(cross, env), cwd=tmp,
                                  report_path=report)
        try:
            group = proc.run_group([cmd], spec.timeout_s, stop=stop)
        except OSError as exc:
            return ProbeResult(spec.candidate, ERROR, cause="worker_error",
                               detail=f"could not start the probe worker {python!r}: {exc}")
    from ..core.measures.probe import parse_probe

    if group.stopped:
        return ProbeResult(spec.candidate, ERROR, round(group.elapsed_s, 3), "inter_node",
                           f"stopped: {group.stopped}")

    return parse_probe(cross, group.outcomes, group.elapsed_s, group.timed_out)


def combine(spec: ProbeSpec, nodes: Sequence[RoundReport], job: Job) -> ProbeResult:
    """One result for a candidate from every node's round report. Pure.

    A failed local group is that node's failure (its cause kept: local remedies apply); else a
    failure between nodes is cause ``inter_node`` (the node's own cause in the detail); else OK
    with the slowest bus (local or between nodes) and the slowest step.
    """
    elapsed = max((n.elapsed_s for n in nodes), default=0.0)
    world = job.nodes * job.local_world
    for n in nodes:
        local = n.local
        if local is not None and not local.ok:
            return replace(local, candidate=spec.candidate, elapsed_s=round(elapsed, 3),
                           ranks=world, detail=f"node {n.node}'s local group: {local.detail}",
                           extra=(("nodes", str(job.nodes)), ("failed_on", "local")))
    crosses = [(n.node, n.cross) for n in nodes]
    failed = [(k, r) for k, r in crosses if r is None or not r.ok]
    if failed:
        return _blame(spec, failed, job, round(elapsed, 3))
    locals_ = [n.local for n in nodes if n.local is not None]
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
        if n.route:
            extra.append((f"route/{n.node}", n.route))
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
