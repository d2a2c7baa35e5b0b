"""``resilient-strategy run``: decide once, launch the workers the decision needs, watch them, and
relaunch on the next candidate when the backend fails mid-run.

Built on torch's elastic agent (the engine under ``torchrun``): torchrun's own argument parser
and ``config_from_args`` read the node options; a :class:`LocalElasticAgent` subclass starts,
monitors and stops the workers, and adds one check to its monitoring loop: the progress watcher
(:class:`TrainingWatch`, on the shared :mod:`resilient_strategy.records.progress` protocol). A stall marks the group UNHEALTHY with no
restart left, which is how the agent itself retires a wedged group; the agent then stops every
worker (SIGTERM, its shutdown timeout, SIGKILL). torchrun's restarts of the same configuration
are off: a relaunch here is on another candidate.

After each attempt :func:`classify_attempt` (pure) reads the stall, the workers' exits, their
error records and their last progress:

- backend fault (all ranks stuck in one collective; a rank raising a communication error; a rank
  vanishing inside a collective): the candidate's mid-run failure is recorded in the decision
  cache for this machine (not for a rehearsed fault), the plan is made again without it, and the
  script is relaunched on the next candidate with the same global batch;
- diverged ranks, an exception in user code, an out-of-memory, a crash outside collectives:
  reported, not retried on another backend.

TensorFlow scripts run as one supervised process (one process drives every GPU there).

With ``--nnodes N`` (torch) the nodes' supervisors agree on each attempt's decision through a
store at the rendezvous endpoint before any worker starts, watch it for each other's fault
records while the workers run, and relaunch together (:mod:`resilient_strategy.run.peers`).
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.bounded import parse_json
from ..core.options import RunOptions
from ..core.probe import ERROR, ProbeResult
from ..errors import NoWorkingStrategyError, ResilientStrategyError
from ..machine import env as _env
from ..records.handoff import CHECKPOINT_NOTE, Decision, write_decision
from ..records.trainfault import FAULT_VAR, parse_fault

if TYPE_CHECKING:
    from .peers import NodeLink, PeerWatch

from .agent import launch
from .arguments import node_count, options_from_args
from .verdicts import Verdict, one_line

log = logging.getLogger("resilient_strategy")

def supervise(opts: RunOptions, env: Mapping[str, str] | None = None) -> int:
    """Run the script to the end, relaunching on the next candidate after each backend fault.
    Returns the exit status for the command line (0: the training finished)."""
    snapshot = _env.snapshot(env)
    fault = parse_fault(snapshot.get(FAULT_VAR, ""))
    session = Path(tempfile.mkdtemp(prefix="resilient-strategy-run-"))
    failures: dict[str, ProbeResult] = {}  # mid-run failures of this session, by candidate key
    causes: list[str] = []
    notes: list[str] = []
    relaunches = 0
    limit = 0
    try:
        from ..machine.inspect import detect_facts

        facts = detect_facts(snapshot)
        link = _link(opts, facts)
        if link is not None:
            _say(f"node {link.node} of {link.nodes}: the nodes' supervisors agree through the "
                 f"store at {link.where} before any worker starts")
        decision, plan_left = _decide(opts, facts, snapshot, failures, session, 0, (), link)
        limit = plan_left if opts.max_relaunches is None else opts.max_relaunches
        for attempt in range(1, 10_000):
            chosen = decision.chosen
            if link is not None and _alone(decision) and link.node != 0:
                _say(f"node {link.node}: node 0 trains alone on {_label(decision)} (no backend "
                     "between the nodes beats one node); this node has nothing to run")
                return 0
            peer = None
            if link is not None:
                from .peers import PeerWatch

                peer = PeerWatch(link, decision.attempt, _store_timeout(opts))
            try:
                verdict = launch(opts, decision, snapshot, session, peer,
                                  alone=link is not None and _alone(decision))
            except Exception as exc:
                if type(exc).__name__ != "SignalException":  # the agent stopped the workers
                    raise
                _say(f"stopped by signal {getattr(exc, 'sigval', '?')}; the workers are stopped")
                return 128 + int(getattr(exc, "sigval", 15))
            if verdict.kind == "ok":
                return 0
            label = _label(decision)
            causes.append(f"{label}: {verdict.summary}")
            if peer is not None:
                verdict = _with_peers(peer, chosen, verdict)
            if not verdict.retry:
                _say(f"{label}: {verdict.summary}. Not relaunched: this is not a backend fault.")
                return 1
            rehearsed = fault is not None and fault.backend == _backend(chosen)
            failures[chosen] = ProbeResult(
                chosen, ERROR, 0.0, verdict.cause,
                f"failed mid-run at step {verdict.step}: {one_line(verdict.summary, 500)}",
                extra=(("mid_run", str(verdict.step)),) + ((("rehearsal", "1"),) if rehearsed
                                                            else ()))
            if not rehearsed:
                _remember(facts, opts, snapshot, {chosen: failures[chosen]})
            if relaunches >= limit:
                _say(f"{label} failed ({verdict.summary}); the relaunch limit ({limit}) is "
                     "reached. Every cause: " + " | ".join(causes))
                return 1
            relaunches += 1
            notes.append(f"Relaunched: {label} failed mid-run at step {verdict.step} "
                         f"({one_line(verdict.summary, 200)}).")
            try:  # the next candidate (probed first when it needs a probe)
                decision, _ = _decide(opts, facts, snapshot, failures, session, attempt,
                                      tuple(notes), link)
            except NoWorkingStrategyError as exc:
                _say(f"{label} failed; no candidate is left: {exc}. Every cause: "
                     + " | ".join(causes))
                return 1
            ckpt = _last_checkpoint(session)
            _say(f"{label} failed at step {verdict.step} ({one_line(verdict.summary, 160)}); "
                 f"relaunching ({relaunches} of {limit}) on {_label(decision)} from "
                 + (f"the checkpoint at step {ckpt[0]} ({ckpt[1]})" if ckpt
                    else "the last checkpoint (noted on the node of rank 0)"
                    if link is not None and link.node != 0
                    else "the start (no checkpoint was noted)"))
        raise ResilientStrategyError("too many launch attempts")  # pragma: no cover
    except ResilientStrategyError as exc:
        _say(str(exc))
        return 2
    finally:
        shutil.rmtree(session, ignore_errors=True)


def _say(text: str) -> None:
    print(f"resilient-strategy run: {text}", file=sys.stderr, flush=True)


def _backend(key: str) -> str:
    return key.split(":")[1] if key.count(":") >= 2 else key


def _label(decision: Decision) -> str:
    return decision.label or decision.chosen


def _options(opts: RunOptions, facts: Any, env: Mapping[str, str], rank: int = 0) -> Any:
    from ..core.options import options_from

    nproc = opts.nproc if opts.nproc is not None else max(1, len(facts.gpus))
    nnodes = node_count(opts)
    plan_env = dict(env)
    fw = opts.framework
    if fw in (None, "torch"):
        plan_env.update({"WORLD_SIZE": str(nproc * nnodes), "LOCAL_WORLD_SIZE": str(nproc),
                         "RANK": str(rank), "LOCAL_RANK": "0"})
    for k in ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "RANK", "LOCAL_RANK"):
        if fw == "tensorflow":
            plan_env.pop(k, None)
    return options_from(
        facts, plan_env, framework=fw, global_batch_size=opts.global_batch_size, devices=None,
        probe=None, timeout=opts.probe_timeout_s, prefer=None, dry_run=False, model=None,
        gradient_bytes=opts.gradient_bytes, sample_seconds=None, max_per_replica_batch=None,
        rules=(), disable_rules=(), cache=True, cache_dir=None, cache_ttl=None, precision="auto",
        logical_cpus=opts.logical_cpus, sharding=opts.sharding, param_bytes=opts.param_bytes,
        optimizer_state_factor=opts.optimizer_state_factor,
    ), plan_env




def _link(opts: RunOptions, facts: Any) -> NodeLink | None:
    """This node's supervisor in a multi-node run (torch), else None."""
    if opts.framework == "tensorflow":
        return None
    from .peers import NodeLink

    nproc = opts.nproc if opts.nproc is not None else max(1, len(facts.gpus))
    return NodeLink.from_torchrun(opts.torchrun, nproc)


def _alone(decision: Decision) -> bool:
    """Node 0 trains alone (one replica, accumulation keeping the global batch)."""
    return decision.nodes == 1


def _store_timeout(opts: RunOptions) -> float:
    return max(10.0, opts.probe_timeout_s or 0.0)


def _with_peers(peer: PeerWatch, chosen: str, verdict: Verdict) -> Verdict:
    """Record this node's verdict for the other nodes, and let a peer's verdict that is not a
    backend fault stop this node too (no node relaunches alone)."""
    if verdict.node is None:  # this node's own verdict, not a peer's relayed
        peer.record({"candidate": chosen, "kind": verdict.kind, "retry": verdict.retry,
                     "step": verdict.step, "cause": verdict.cause,
                     "summary": one_line(verdict.summary, 500)})
    if verdict.retry:
        from ..nodes.store import recorded_faults

        with contextlib.suppress(Exception):
            for node, fault in sorted(recorded_faults(peer.store, peer.job).items()):
                if node != peer.link.node and not fault.get("retry", True):
                    return Verdict(str(fault.get("kind", "crash")),
                                   f"node {node}: {fault.get('summary', '')}",
                                   int(fault.get("step", 0) or 0), node=node)
    return verdict


def _decide(opts: RunOptions, facts: Any, env: Mapping[str, str],
            failures: Mapping[str, ProbeResult], session: Path, attempt: int,
            notes: tuple[str, ...], link: NodeLink | None = None) -> tuple[Decision, int]:
    """Plan (probing as needed, the cache first), without the candidates that failed mid-run.
    With several nodes, the nodes agree through the rendezvous endpoint's store
    (:mod:`.runnodes`). Returns the decision and how many candidates are left after the chosen
    one."""
    import functools

    from ..deciding.executor import _cause, _progress_line, decide

    if link is None:
        o, plan_env = _options(opts, facts, env)
    else:
        o, plan_env = _options(opts, facts, link.env(env, attempt), link.node * link.nproc)
    if link is None:
        made = decide(facts, o, plan_env, _prober, time.monotonic, _progress_line(o),
                      startup_check=True, known=failures)
        p, results, from_cache, proven = made.plan, made.results, made.from_cache, made.proven
    else:
        from ..nodes.manynodes import agreed_decision

        p, results, from_cache, proven = agreed_decision(
            facts, o, plan_env, _prober, time.monotonic,
            functools.partial(decide, progress=_progress_line(o), startup_check=True,
                              known=dict(failures)))
        results = {**results, **failures}
    if p.chosen is None:
        raise NoWorkingStrategyError(o.framework, [_cause(r) for r in p.ruled_out])
    run_dir = session / f"attempt{attempt}"
    run_dir.mkdir()
    left = sum(1 for r in p.ranked if r.candidate.key != p.chosen.key)
    decision = Decision(
        framework=o.framework, chosen=p.chosen.key, results=results, run_dir=str(run_dir),
        attempt=attempt, proven=proven, from_cache=from_cache, notes=notes,
        global_batch_size=o.global_batch_size, label=p.chosen.label,
        # torch: one process per replica, split over the nodes; TensorFlow: one drives them all
        processes=max(1, p.chosen.num_replicas // node_count(opts)) if o.framework == "torch" else 1,
        nodes=1 if o.framework != "torch" or p.chosen.num_replicas == 1 else node_count(opts),
        node_trace=_node_trace(p.events) if link is not None else (),
        reference_replicas=p.reference_replicas)
    write_decision(run_dir / "decision.json", decision)
    return decision, left


def _node_trace(events: Sequence[Any]) -> tuple[str, ...]:
    """The lines :func:`~resilient_strategy.nodes.manynodes.agreed_decision` added to the trace (the
    trailing ``multi_node`` notes), for the workers' explain()."""
    from ..core.trace import Note

    out: list[str] = []
    for e in reversed(events):
        if not (isinstance(e, Note) and e.topic == "multi_node"):
            break
        out.append(e.message)
    return tuple(reversed(out))


def _prober(spec: Any, env: Mapping[str, str]) -> ProbeResult:
    from ..probing.prober import run_probe

    return run_probe(spec, env)


def _remember(facts: Any, opts: RunOptions, env: Mapping[str, str],
              results: Mapping[str, ProbeResult]) -> None:
    from ..deciding.cache import DecisionCache

    o, _ = _options(opts, facts, env)
    if o.cache_dir is not None and o.nodes == 1:
        DecisionCache(o.cache_dir, o.cache_ttl_s).store(facts.fingerprint(), results)


def _last_checkpoint(session: Path) -> tuple[int, str] | None:
    best: tuple[int, str] | None = None
    for note in session.glob(f"attempt*/{CHECKPOINT_NOTE}"):
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            data = parse_json(note.read_bytes(), str(note), allow_nan=True)  # bounded
            if best is None or int(data["step"]) > best[0]:
                best = (int(data["step"]), str(data["path"]))
    return best


def main(argv: Sequence[str]) -> int:
    try:
        import torch.distributed.run  # noqa: F401
    except ImportError:
        _say("needs torch: it runs the workers through torch's elastic agent (pip install torch)")
        return 2
    try:
        opts = options_from_args(argv)
    except ResilientStrategyError as exc:
        _say(str(exc))
        return 2
    if not Path(opts.script).is_file():
        _say(f"no such script: {opts.script}")
        return 2
    logging.getLogger("torch.distributed.elastic").setLevel(logging.ERROR)
    return supervise(replace(opts))

