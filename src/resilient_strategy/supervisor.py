"""``resilient-strategy run``: decide once, launch the workers the decision needs, watch them, and
relaunch on the next candidate when the backend fails mid-run.

Built on torch's elastic agent (the engine under ``torchrun``): torchrun's own argument parser
and ``config_from_args`` read the node options; a :class:`LocalElasticAgent` subclass starts,
monitors and stops the workers, and adds one check to its monitoring loop: the progress watcher
(:class:`TrainingWatch`, on the shared :mod:`resilient_strategy.progress` protocol). A stall marks the group UNHEALTHY with no
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
records while the workers run, and relaunch together (:mod:`resilient_strategy.runnodes`).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import _env
from ._bounded import parse_json
from .errors import InvalidOptionError, NoWorkingStrategyError, ResilientStrategyError
from .handoff import CHECKPOINT_NOTE, Decision, error_path, progress_path, write_decision
from .options import MIN_STALL_S, RunOptions, run_options_from
from .probe import ERROR, ProbeResult
from .progress import (
    COLLECTIVE,
    COLLECTIVE_DONE,
    FINISHED,
    STEP_DONE,
    Record,
    Stall,
    StallPolicy,
    StallWatcher,
    read_record,
)
from .trainfault import FAULT_VAR, parse_fault

if TYPE_CHECKING:
    from .runnodes import NodeLink, PeerWatch

log = logging.getLogger("resilient_strategy")

# ------------------------------------------------------------------------------------------------
# Classification (pure)
# ------------------------------------------------------------------------------------------------
_COMM_TYPES = ("DistBackendError", "DistNetworkError", "DistStoreError", "DistError",
               "RehearsedCommunicationError")
_OOM_TYPES = ("OutOfMemoryError", "ResourceExhaustedError", "MemoryError")
_COMM_TEXT = re.compile(
    r"NCCL|nccl|[Gg]loo|Connection (closed|reset) by peer|ProcessGroup|c10d|"
    r"Watchdog caught collective|collective operation timeout|CUDA error|illegal memory access|"
    r"Broken pipe|unhandled system error")
_OOM_TEXT = re.compile(r"out of memory|OOM when allocating", re.IGNORECASE)


def classify_error(types: Sequence[str], message: str) -> str:
    """"oom", "comm", "exit" (SystemExit) or "user" for an exception's MRO names and message."""
    names = {t.rsplit(".", 1)[-1] for t in types}
    if names & set(_OOM_TYPES) or _OOM_TEXT.search(message):
        return "oom"
    if names & set(_COMM_TYPES):
        return "comm"
    if "SystemExit" in names:
        return "exit"
    if names & {"RuntimeError", "OSError", "ConnectionError"} and _COMM_TEXT.search(message):
        return "comm"
    return "user"


@dataclass(frozen=True)
class RankExit:
    """What one failed worker left behind."""

    rank: int  # local rank
    exitcode: int  # negative: killed by that signal
    error: Mapping[str, Any] | None = None  # its error record (handoff.write_error)
    record: Record | None = None  # its last progress report
    stderr_tail: str = ""

    @property
    def error_kind(self) -> str | None:
        if self.error is None:
            return None
        return classify_error(list(self.error.get("types", ())), str(self.error.get("message", "")))

    def describe(self) -> str:
        if self.error is not None:
            types = list(self.error.get("types", ()))
            name = types[0].rsplit(".", 1)[-1] if types else "error"
            what = f"{name}: {self.error.get('message', '')}".strip()
        elif self.exitcode < 0:
            what = f"killed by signal {-self.exitcode}"
        else:
            what = f"exited with status {self.exitcode} without a Python exception"
        where = "" if self.record is None else f" ({_position(self.record)})"
        return f"rank {self.rank}{where}: {_one_line(what)}"


@dataclass(frozen=True)
class Verdict:
    """What an attempt came to."""

    kind: str  # "ok", "backend", "diverged", "oom", "user", "crash"
    summary: str
    step: int = 0
    cause: str = ""  # a probe cause key, for the cache record of a backend fault
    node: int | None = None  # another node's record this node stopped for (multi-node)

    @property
    def retry(self) -> bool:
        return self.kind == "backend"


def _position(record: Record) -> str:
    if record.phase in (COLLECTIVE, "collective_done"):
        return f"{record.phase.replace('_', ' ')} of step {record.k}"
    if record.phase == STEP_DONE:
        return f"after step {record.k}"
    return record.phase.replace("_", " ")


def step_in_progress(records: Sequence[Record | None]) -> int:
    """The optimizer step the ranks had reached (a collective's number is its step's)."""
    return max((r.k for r in records if r is not None), default=0)


def classify_attempt(stall: Stall | None, exits: Sequence[RankExit]) -> Verdict:
    """The verdict on one attempt from its stall (if the watcher declared one) and the exits of
    its failed workers (none: it succeeded). Pure.

    A stall inside communicator setup or one collective (every rank entered it, some never
    left) is a backend fault; ranks that never arrived where the others wait ("straggler")
    diverged: the application's problem."""
    if stall is not None:
        if stall.kind in ("collective", "setup"):
            return Verdict("backend", f"stalled: {stall.describe()}", stall.k, "timeout")
        return Verdict("diverged", f"the ranks diverged: {stall.describe()}. The program did not "
                       "run the same collectives on every rank (another backend would not help)",
                       stall.k)
    if not exits:
        return Verdict("ok", "finished")
    step = step_in_progress([e.record for e in exits])
    text = "; ".join(e.describe() for e in exits)
    kinds = [e.error_kind for e in exits]
    if "oom" in kinds:
        return Verdict("oom", f"out of memory: {text}", step)
    if "user" in kinds or "exit" in kinds:
        return Verdict("user", f"the script failed: {text}", step)
    if "comm" in kinds:
        cause = "nccl_error" if any("nccl" in str((e.error or {}).get("message", "")).lower()
                                    for e in exits) else "crash"
        return Verdict("backend", f"a communication error: {text}", step, cause)
    in_collective = [e for e in exits if e.record is not None and e.record.phase == COLLECTIVE]
    comm_tail = [e for e in exits if _COMM_TEXT.search(e.stderr_tail)]
    if in_collective or comm_tail:
        return Verdict("backend", f"a rank left in the middle of a collective: {text}", step,
                       "crash")
    return Verdict("crash", f"a worker crashed outside any collective: {text}", step)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ------------------------------------------------------------------------------------------------
# Watching training ranks
# ------------------------------------------------------------------------------------------------
#: The default stall timeout: the larger of MIN_STALL_S and STALL_STEPS x the median step time.
STALL_STEPS = 20


def default_stall_timeout(step_seconds: Sequence[float]) -> float:
    """max(MIN_STALL_S, STALL_STEPS x the median optimizer step time) once steps were seen."""
    if not step_seconds:
        return MIN_STALL_S
    return max(MIN_STALL_S, STALL_STEPS * statistics.median(step_seconds))


def training_policy(timeout_s: float) -> StallPolicy:
    """The progress judge's policy for training ranks: one stall timeout for every wait
    (communicator setup, a collective every rank entered, ranks that never arrived), no
    transfer-size allowance (a training step's all-reduce is timed by the step), and no limit
    on time spent in the user's own code (evaluation, data loading: nobody waits on a peer)."""
    return StallPolicy(setup_grace_s=timeout_s, arrive_grace_s=timeout_s,
                       collective_base_s=timeout_s, first_collective_extra_s=0.0, safety=0.0,
                       quiet_s=None)


class TrainingWatch:
    """The supervisor's judge: the shared :class:`~resilient_strategy.progress.StallWatcher`
    with :func:`training_policy`, its timeout fixed (``--stall-timeout``) or following the median
    step time seen in rank 0's records. One place owns this deadline."""

    def __init__(self, paths: Sequence[str], timeout_s: float | None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.fixed = timeout_s
        self.clock = clock
        self.step_seconds: list[float] = []
        self._last: tuple[int, float] | None = None  # rank 0's last step record: (k, t)
        self.watcher = StallWatcher(paths, training_policy(self.timeout_s()), clock)

    def timeout_s(self) -> float:
        if self.fixed is not None:
            return self.fixed
        return default_stall_timeout(self.step_seconds[-200:])

    def poll(self) -> Stall | None:
        now = self.clock()
        self.watcher.read(now)
        records = self.watcher.records
        if any(r is not None and r.phase == FINISHED for r in records):
            return None  # finishing: the exits are the agent's to see
        rec = records[0] if records else None
        if rec is not None and rec.phase in (STEP_DONE, COLLECTIVE_DONE) and rec.k > 0:
            if self._last is not None and rec.k > self._last[0] and rec.t > self._last[1]:
                self.step_seconds.append((rec.t - self._last[1]) / (rec.k - self._last[0]))
            if self._last is None or rec.k != self._last[0]:
                self._last = (rec.k, rec.t)
        if self.fixed is None:
            self.watcher.policy = training_policy(self.timeout_s())
        return self.watcher.judge(now)


# ------------------------------------------------------------------------------------------------
# Options
# ------------------------------------------------------------------------------------------------
def guess_framework(script_text: str) -> str | None:
    """The framework a script trains with, from its text (None when it does not say)."""
    m = re.search(r"framework\s*=\s*[\"'](tensorflow|tf|keras|torch|pytorch)[\"']", script_text)
    if m:
        return {"tf": "tensorflow", "keras": "tensorflow", "pytorch": "torch"}.get(
            m.group(1), m.group(1))
    tf = re.search(r"^\s*(import|from)\s+(tensorflow|keras)\b", script_text, re.MULTILINE)
    torch = re.search(r"^\s*(import|from)\s+torch\b", script_text, re.MULTILINE)
    if bool(tf) != bool(torch):
        return "tensorflow" if tf else "torch"
    return None


# ------------------------------------------------------------------------------------------------
# The supervisor
# ------------------------------------------------------------------------------------------------
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
        from .inspect import detect_facts

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
                from .runnodes import PeerWatch

                peer = PeerWatch(link, decision.attempt, _store_timeout(opts))
            try:
                verdict = _launch(opts, decision, snapshot, session, peer,
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
                f"failed mid-run at step {verdict.step}: {_one_line(verdict.summary, 500)}",
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
                         f"({_one_line(verdict.summary, 200)}).")
            try:  # the next candidate (probed first when it needs a probe)
                decision, _ = _decide(opts, facts, snapshot, failures, session, attempt,
                                      tuple(notes), link)
            except NoWorkingStrategyError as exc:
                _say(f"{label} failed; no candidate is left: {exc}. Every cause: "
                     + " | ".join(causes))
                return 1
            ckpt = _last_checkpoint(session)
            _say(f"{label} failed at step {verdict.step} ({_one_line(verdict.summary, 160)}); "
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
    from .options import options_from

    nproc = opts.nproc if opts.nproc is not None else max(1, len(facts.gpus))
    nnodes = _nnodes(opts)
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
        logical_cpus=opts.logical_cpus,
    ), plan_env


def _nnodes(opts: RunOptions) -> int:
    ns = opts.torchrun
    if ns is None:
        return 1
    text = str(getattr(ns, "nnodes", "1"))
    return int(text.split(":")[-1])


def _link(opts: RunOptions, facts: Any) -> NodeLink | None:
    """This node's supervisor in a multi-node run (torch), else None."""
    if opts.framework == "tensorflow":
        return None
    from .runnodes import NodeLink

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
                     "summary": _one_line(verdict.summary, 500)})
    if verdict.retry:
        from .multinode import recorded_faults

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

    from .executor import _cause, _progress_line, decide

    if link is None:
        o, plan_env = _options(opts, facts, env)
    else:
        o, plan_env = _options(opts, facts, link.env(env, attempt), link.node * link.nproc)
    if link is None:
        made = decide(facts, o, plan_env, _prober, time.monotonic, _progress_line(o),
                      startup_check=True, known=failures)
        p, results, from_cache, proven = made.plan, made.results, made.from_cache, made.proven
    else:
        from .multinode import agreed_decision

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
        processes=max(1, p.chosen.num_replicas // _nnodes(opts)) if o.framework == "torch" else 1,
        nodes=1 if o.framework != "torch" or p.chosen.num_replicas == 1 else _nnodes(opts),
        node_trace=_node_trace(p.events) if link is not None else (),
        reference_replicas=p.reference_replicas)
    write_decision(run_dir / "decision.json", decision)
    return decision, left


def _node_trace(events: Sequence[Any]) -> tuple[str, ...]:
    """The lines :func:`~resilient_strategy.multinode.agreed_decision` added to the trace (the
    trailing ``multi_node`` notes), for the workers' explain()."""
    from .trace import Note

    out: list[str] = []
    for e in reversed(events):
        if not (isinstance(e, Note) and e.topic == "multi_node"):
            break
        out.append(e.message)
    return tuple(reversed(out))


def _prober(spec: Any, env: Mapping[str, str]) -> ProbeResult:
    from .prober import run_probe

    return run_probe(spec, env)


def _remember(facts: Any, opts: RunOptions, env: Mapping[str, str],
              results: Mapping[str, ProbeResult]) -> None:
    from .cache import DecisionCache

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


# ------------------------------------------------------------------------------------------------
# One attempt, through torch's elastic agent
# ------------------------------------------------------------------------------------------------
def _launch(opts: RunOptions, decision: Decision, env: Mapping[str, str],
            session: Path, peer: PeerWatch | None = None, *, alone: bool = False) -> Verdict:
    """One attempt. ``peer``: the other nodes' fault records, watched while the workers run;
    ``alone``: node 0 of a multi-node run trains by itself (one node, its own rendezvous)."""
    run_dir = Path(decision.run_dir)
    nproc = decision.processes
    watch = TrainingWatch([str(progress_path(run_dir, r)) for r in range(nproc)],
                          opts.stall_timeout_s)
    agent_cls = _agent_class()
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.agent.server.api import WorkerSpec
    from torch.distributed.elastic.rendezvous import RendezvousParameters
    from torch.distributed.elastic.rendezvous import registry as rdzv_registry

    ns = argparse.Namespace(**vars(opts.torchrun or _parser().parse_args([opts.script])))
    ns.nproc_per_node = str(nproc)
    ns.max_restarts = 0  # a relaunch is ours, on another candidate
    ns.log_dir = str(run_dir / "logs")
    if not (getattr(ns, "redirects", "") or getattr(ns, "tee", "")):
        ns.tee = "2"  # stderr to the console and to a file we can read
    nnodes = _nnodes(opts)
    if alone:
        ns.nnodes, ns.node_rank, ns.rdzv_conf, ns.standalone = "1", 0, "", True
        nnodes = 1
    if getattr(ns, "standalone", False) or (nnodes == 1 and not ns.rdzv_endpoint
                                            and ns.rdzv_backend == "static"
                                            and ns.master_port is None):
        ns.rdzv_backend, ns.rdzv_endpoint = "c10d", "localhost:0"
        ns.rdzv_id = str(uuid.uuid4())
    elif ns.rdzv_id == "none" or not ns.rdzv_id:
        ns.rdzv_id = f"resilient-strategy-{decision.attempt}"
    else:
        ns.rdzv_id = f"{ns.rdzv_id}-attempt{decision.attempt}"
    if ns.master_port is None:
        ns.master_port = 29500
    had_omp = "OMP_NUM_THREADS" in os.environ
    try:
        config, _, _ = torchrun.config_from_args(ns)
    finally:
        if not had_omp and nproc == 1:
            os.environ.pop("OMP_NUM_THREADS", None)
    rdzv = RendezvousParameters(
        backend=config.rdzv_backend, endpoint=config.rdzv_endpoint, run_id=config.run_id,
        min_nodes=config.min_nodes, max_nodes=config.max_nodes, local_addr=config.local_addr,
        **config.rdzv_configs)
    master_addr = master_port = None
    if rdzv.backend == "static":
        from torch.distributed.elastic.rendezvous.utils import parse_rendezvous_endpoint

        master_addr, master_port = parse_rendezvous_endpoint(rdzv.endpoint, default_port=-1)
    spec = WorkerSpec(
        role=config.role, local_world_size=nproc, entrypoint=sys.executable,
        args=("-u", "-m", "resilient_strategy._runworker", str(run_dir / "decision.json"),
              opts.script, *opts.script_args),
        rdzv_handler=rdzv_registry.get_rendezvous_handler(rdzv), max_restarts=0,
        monitor_interval=config.monitor_interval, master_addr=master_addr,
        master_port=master_port, local_addr=config.local_addr)
    agent = agent_cls(spec=spec, logs_specs=config.logs_specs, start_method=config.start_method,
                      watch=watch, peer=peer)
    try:
        result = agent.run()
    finally:
        with contextlib.suppress(Exception):
            spec.rdzv_handler.shutdown()
        if not had_omp:
            os.environ.pop("OMP_NUM_THREADS", None)
    if agent.peer_fault is not None:  # another node saw the fault: this node stopped for it
        f = agent.peer_fault
        retry = bool(f.get("retry", True))
        return Verdict("backend" if retry else str(f.get("kind", "crash")),
                       f"node {f.get('node')}: {f.get('summary', '')}",
                       int(f.get("step", 0) or 0), str(f.get("cause", "") or "crash"),
                       node=int(f.get("node", -1)))
    stall: Stall | None = agent.stall
    if stall is not None and any(error_path(run_dir, lr).exists() for lr in range(nproc)):
        stall = None  # a rank raised and had not exited yet: its error is the story, not a stall
    exits: list[RankExit] = []
    if stall is None:
        for failure in (result.failures.values() if result.is_failed() else ()):
            lr = failure.local_rank
            exits.append(RankExit(
                rank=lr, exitcode=failure.exitcode, error=_read_json(error_path(run_dir, lr)),
                record=read_record(str(progress_path(run_dir, lr))),
                stderr_tail=_stderr_tail(run_dir / "logs", lr)))
        # ranks that raised but were stopped before the agent saw them exit left records too
        seen = {e.rank for e in exits}
        for lr in range(nproc):
            err = _read_json(error_path(run_dir, lr))
            if lr not in seen and err is not None:
                exits.append(RankExit(rank=lr, exitcode=1, error=err,
                                      record=read_record(str(progress_path(run_dir, lr))),
                                      stderr_tail=_stderr_tail(run_dir / "logs", lr)))
        if not exits and result.state.name != "SUCCEEDED":
            return Verdict("crash", f"the workers ended in state {result.state.name}")
    return classify_attempt(stall, exits)


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = parse_json(path.read_bytes(), str(path), allow_nan=True)  # bounded
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _stderr_tail(log_dir: Path, local_rank: int, limit: int = 8192) -> str:
    for path in log_dir.glob(f"**/{local_rank}/stderr.log"):
        with contextlib.suppress(OSError), open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - limit))
            return fh.read().decode("utf-8", "replace")
    return ""


_AGENT: list[type[Any]] = []


def _agent_class() -> type[Any]:
    """LocalElasticAgent plus the stall watch in its monitoring loop (built on first use)."""
    if _AGENT:
        return _AGENT[0]
    from torch.distributed.elastic.agent.server.api import RunResult, WorkerState
    from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent

    class SupervisedAgent(LocalElasticAgent):
        def __init__(self, *args: Any, watch: TrainingWatch, peer: PeerWatch | None = None,
                     **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.watch = watch
            self.peer = peer
            self.stall: Stall | None = None
            self.peer_fault: dict[str, Any] | None = None

        def _monitor_workers(self, worker_group: Any) -> Any:
            result = super()._monitor_workers(worker_group)
            if result.state == WorkerState.HEALTHY and self.stall is None:
                stall = self.watch.poll()
                if stall is not None:
                    self.stall = stall
                    # as the agent does for a wedged (D-state) worker: no restart, stop the group
                    self._remaining_restarts = 0
                    return RunResult(state=WorkerState.UNHEALTHY)
            if (result.state == WorkerState.HEALTHY and self.peer is not None
                    and self.peer_fault is None):
                fault = self.peer.poll()
                if fault is not None:  # another node's workers failed: stop ours too
                    self.peer_fault = fault
                    self._remaining_restarts = 0
                    return RunResult(state=WorkerState.UNHEALTHY)
            return result

    _AGENT.append(SupervisedAgent)
    return SupervisedAgent


# ------------------------------------------------------------------------------------------------
# Command line
# ------------------------------------------------------------------------------------------------
def _parser() -> argparse.ArgumentParser:
    from torch.distributed.run import get_args_parser

    p = get_args_parser()
    p.prog = "resilient-strategy run"
    p.description = ("Run a training script on the strategy that works here and keep it running: "
                     "relaunch on the next candidate when a collective fails or stalls mid-run. "
                     "Takes torchrun's options.")
    p.add_argument("--max-relaunches", type=int, default=None,
                   help="relaunches at most (default: the candidates left)")
    p.add_argument("--stall-timeout", type=float, default=None,
                   help="seconds without progress on any rank before a stall is declared "
                        "(default: max(60, 20 x the median step time))")
    p.add_argument("--framework", choices=("torch", "tensorflow"), default=None,
                   help="the script's framework (default: read from the script)")
    p.add_argument("--global-batch-size", type=int, default=None,
                   help="for ranking the candidates (the script's own value is used in training)")
    p.add_argument("--gradient-bytes", type=int, default=None,
                   help="the model's gradient bytes, for ranking the candidates")
    p.add_argument("--probe-timeout", type=float, default=None, help="seconds per probe")
    p.add_argument("--logical-cpus", type=int, default=0,
                   help="TensorFlow test mode: plan for N logical CPU devices (the script "
                        "passes logical_cpus=N too)")
    return p


def options_from_args(argv: Sequence[str]) -> RunOptions:
    """Parse ``resilient-strategy run`` arguments (torchrun's, plus ours)."""
    ns = _parser().parse_args(list(argv))
    if getattr(ns, "module", False) or getattr(ns, "no_python", False) or getattr(
            ns, "run_path", False):
        raise InvalidOptionError("resilient-strategy run runs a Python script file; -m, "
                                 "--no-python and --run-path are not supported")
    script = str(ns.training_script)
    ours = list(argv)[:list(argv).index(script)] if script in argv else list(argv)
    if not any(t.split("=")[0] in ("--master-port", "--master_port") for t in ours):
        # not given: None, as torch >= 2.12's parser says (2.11's says 29500), so that a
        # one-node run takes a free port (standalone) and two jobs on a machine do not collide
        ns.master_port = None
    framework = ns.framework
    if framework is None:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            framework = guess_framework(Path(script).read_text(encoding="utf-8"))
    return run_options_from(
        _env.snapshot(), script=script, script_args=tuple(ns.training_script_args),
        framework=framework, nproc=str(ns.nproc_per_node), max_relaunches=ns.max_relaunches,
        stall_timeout=ns.stall_timeout, global_batch_size=ns.global_batch_size,
        gradient_bytes=ns.gradient_bytes, probe_timeout=ns.probe_timeout,
        logical_cpus=ns.logical_cpus, torchrun=ns)


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
