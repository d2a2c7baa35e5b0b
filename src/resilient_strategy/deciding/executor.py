"""The executor: guard, inspect, plan, probe, apply. The one place that acts on a plan.

``resilient_strategy()`` reads the environment once (explicit argument > the user's environment >
our default), plans purely, proves candidates with killable probes (or reuses cached results),
sets the chosen environment without overriding anything the user set, and returns a Selection.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..core.call.arguments import (
    Arguments,
    options_from,
    unexpected_keywords,
)
from ..core.call.options import FRAMEWORKS, Options
from ..core.knowledge.rules import Rule
from ..core.measures.memory import MemoryRow
from ..core.measures.probe import (
    ProbeResult,
)
from ..core.planning.plan import Candidate, MeasuredStep, Plan, plan
from ..core.trace.choosing import Chosen, NextProbe
from ..core.trace.event import Event, Note
from ..core.trace.fitting import FewerDevices, MemoryChecked, OffloadConsidered
from ..core.trace.inputs import FrameworkPicked, GpusBound, LauncherSeen
from ..core.values.binding import Binding, bind
from ..core.values.candidate import CandidateKey
from ..core.values.facts import Facts, Visibility, relevant_env
from ..core.values.human import brief, human_bytes, human_duration
from ..errors import (
    InvalidOptionError,
    InvalidRuleError,
    InvalidVisibleDevicesError,
    MemoryShortfall,
    ModelDoesNotFitError,
    NoWorkingStrategyError,
    RanksDisagreeError,
    ResilientStrategyError,
)
from ..machine import env as machine_env
from ..selection import Selection
from .notices import (
    ProgressLine,
    batch_notice,
    fallback_warning,
    progress_line_for,
)

if TYPE_CHECKING:
    from ..core.values.launcher import Launcher
    from ..records.handoff import HandedDecision, TrainingReporter

from ..probing.base import ProbeFn, Prober, as_prober
from .decide import (
    Decision,
    decide,
    default_prober,
    failure_cause,
)

log = logging.getLogger("resilient_strategy")
#: The most characters of a rule's warning as logged (its whole text: sel.explain(verbose=True)).
WARNING_CHARS = 200
#: What ends a warning's short line that left a part out: where the whole text is.
WARNING_MORE = " (sel.explain(verbose=True))"



def _visible_devices_value(facts: Facts, c: Candidate) -> str:
    """CUDA_VISIBLE_DEVICES naming exactly the chosen GPUs, by UUID where known."""
    by_index = {g.index: g for g in facts.gpus}
    return ",".join(
        by_index[d].uuid or str(by_index[d].physical_index) for d in c.devices if d in by_index
    )


def _env_to_set(facts: Facts, c: Candidate, opts: Options, env: Mapping[str, str]) -> dict[str, str]:
    wanted = dict(c.env)
    if (
        c.framework == "tensorflow"
        and c.devices
        and len(c.devices) < len(facts.gpus)
        and "CUDA_VISIBLE_DEVICES" not in env
    ):
        # TF takes memory on every visible GPU; show it only the chosen ones.
        wanted["CUDA_VISIBLE_DEVICES"] = _visible_devices_value(facts, c)
    return {k: v for k, v in wanted.items() if k not in env}


@dataclass(frozen=True)
class Engine:
    """The decision engine with what proves candidates injected: ``resilient_strategy()`` is
    ``Engine().select(...)`` with the real prober; the testing kit runs it with a described
    machine's prober (``SimulatedProber``) or a test's own.

    ``prober``: a `Prober` (or a plain function ``(spec, env) -> ProbeResult``); ``clock``:
    the monotonic clock the probe budget is spent on (None: the prober's own, `Prober.clock`);
    ``alone``: the launch is only planned (the command line's ``--nproc-per-node``), no other
    rank exists to share the decision with.
    """

    prober: Prober | ProbeFn = default_prober
    clock: Callable[[], float] | None = None
    alone: bool = False

    def select(self, arguments: Arguments, *, env: Mapping[str, str] | None = None,
               facts: Facts | None = None) -> Selection:
        """The Selection for ``arguments`` (``resilient_strategy()``'s, as one value), deciding
        on ``env`` (None: ``os.environ``, and the choice is applied to it) and ``facts``
        (None: this machine, inspected)."""
        try:
            return _decide_and_apply(arguments, env, facts, self)
        except (InvalidOptionError, InvalidRuleError) as exc:
            # the caller's mistake: one frame (this one) under the caller's line, not the
            # library's internals; the typed error, its fields and its one-line message are kept
            raise exc.with_traceback(None) from None


def resilient_strategy(
    framework: str | None = None, *, global_batch_size: int | None = None,
    devices: Sequence[int] | None = None, probe: str | bool | None = None,
    timeout: float | None = None, prefer: str | None = None, dry_run: bool = False,
    model: Any = None, gradient_bytes: int | None = None, sample_seconds: float | None = None,
    max_per_replica_batch: int | None = None, rules: Sequence[str | Path | Rule] = (),
    disable_rules: Sequence[str] = (), cache: bool = True, cache_dir: str | Path | None = None,
    cache_ttl: float | None = None, precision: str = "auto",
    process_group_timeout: float | None = None, env: Mapping[str, str] | None = None,
    facts: Facts | None = None, logical_cpus: int = 0, quiet: bool | None = None,
    sharding: str = "auto", offload: str = "none", param_bytes: int | None = None,
    optimizer_state_factor: float | None = None, **unknown: Any,
) -> Selection:
    """Find the best distributed strategy that works here and return a Selection to train with.

    Args:
        framework: "torch" or "tensorflow"; None picks the one imported or installed.
        global_batch_size: samples per optimizer step; kept exact on every fallback.
        devices: GPU indices (as the job sees them) to consider; default all visible.
        probe: "auto" (probe unless cached), "force" (re-probe), "never" (trust the plan).
        timeout: seconds per probe (default 30; the whole decision is bounded by 4x this).
        prefer: a backend to try first when it works.
        dry_run: decide without probing, setting variables or building anything.
        model: the model (its gradient size ranks the strategies by speed).
        gradient_bytes: the model's gradient size in bytes, when the model does not exist yet.
        sample_seconds: the compute time of one sample, for speed ranking.
        max_per_replica_batch: the largest batch one replica may take (more accumulates).
        rules: extra rule files (or Rule values).
        disable_rules: rule ids to switch off.
        cache: read and write the decision cache (default on).
        cache_dir: where the cache lives (default ~/.cache/resilient_strategy).
        cache_ttl: seconds a cached result stays valid (default 7 days).
        precision: "auto", "bf16", "fp16" or "fp32" (PyTorch; auto: bf16 from compute
            capability 8.0, fp16 with a GradScaler on 7.x).
        env: the environment to decide on (default os.environ; nothing is ever overwritten).
        facts: decide for described facts instead of inspecting this machine.
        logical_cpus: TensorFlow on N logical CPU devices instead of GPUs (testing on CPU;
            never cached).
        process_group_timeout: seconds a training collective may wait for a peer before the
            PyTorch process group fails (default 300).
        quiet: True: no progress line per probe on stderr; False: one even when stderr is not a
            terminal; None (default): one when stderr is a terminal (RESILIENT_STRATEGY_QUIET).
        sharding: "auto" (default) shards the model over the replicas (PyTorch FSDP2) only when a
            replica does not fit the GPUs' free memory; "full" always shards; "none" never.
        offload: "none" (default) keeps the model's state on the GPUs; "auto" lets the plan
            move a sharded model's parameters, gradients and optimizer state to host memory
            (FSDP2's CPUOffloadPolicy) where no candidate that keeps them on the GPUs fits.
        param_bytes: the model's parameter bytes (model= gives them), for memory planning:
            candidates whose state does not fit their devices are ruled out.
        optimizer_state_factor: the optimizer's state per gradient byte (default 2, AdamW),
            for the same memory planning.
        **unknown: none is accepted: an unknown keyword is a `TypeError` naming the closest
            known one.

    Returns:
        The [Selection][resilient_strategy.selection.Selection]: what was chosen, why
            ([explain][resilient_strategy.selection.Selection.explain]), and the handle to train with it.

    Raises:
        TypeError: an unknown keyword argument (the message names the closest known one).
        InvalidOptionError: an argument or a `RESILIENT_STRATEGY_*` variable out of range or
            malformed; one line naming it, what is wrong and what is allowed.
        InvalidRuleError: a rule file or rule value that is malformed.
        FrameworkNotInstalledError: the framework asked for is not installed.
        NoWorkingStrategyError: no candidate worked here, not even the CPU.
        ModelDoesNotFitError: the model's state fits no candidate's memory.
        ResilientStrategyError: the base of every error above but `TypeError`, and of the
            others this call can raise (a GPU already initialized, a multi-node agreement that
            failed); every one is listed in the Errors reference.
    """
    if unknown:
        raise TypeError(_unknown_keywords(unknown)) from None
    # the one options value, its groups filled by name (options_from validates it, once)
    given = {k: v for k, v in locals().items() if k not in ("env", "facts", "unknown")}
    arguments = Arguments.from_kwargs(**given)
    try:
        return Engine().select(arguments, env=env, facts=facts)
    except (InvalidOptionError, InvalidRuleError) as exc:  # one frame under the caller's line
        raise exc.with_traceback(None) from None


def _unknown_keywords(unknown: Mapping[str, Any]) -> str:
    """``resilient_strategy() got an unexpected keyword argument 'x'``, with the closest known
    keyword where one is close."""
    import inspect

    known = [n for n in inspect.signature(resilient_strategy).parameters if n != "unknown"]
    return unexpected_keywords("resilient_strategy()", list(unknown), known)


def _decide_and_apply(arguments: Arguments, env: Mapping[str, str] | None,
                      facts: Facts | None, engine: Engine) -> Selection:
    """The body of [resilient_strategy][resilient_strategy.resilient_strategy]: inspect,
    validate, decide (or take the decision handed down), apply, and build the Selection."""
    t0 = time.perf_counter()
    from ..machine.scontrol import detect_launcher

    snapshot = machine_env.snapshot(env)
    launcher = detect_launcher(snapshot)
    snapshot = launcher.environment(snapshot)  # SLURM's ranks under torchrun's names
    described = facts is not None
    if facts is None:
        from ..machine.inspect import detect_facts

        facts = detect_facts(snapshot)
    _check_visibility(facts)
    opts = options_from(facts, snapshot, arguments)
    prober = as_prober(engine.prober)
    if prober.simulated:  # outcomes from a description: say so everywhere
        opts = replace(opts, simulated=True)
    if launcher.derived and env is None and not opts.dry_run:
        # for the framework's env:// rendezvous (torch reads os.environ), never over the user's
        machine_env.apply(launcher.derived)
    from ..records.handoff import load_decision

    handed = None if opts.dry_run else load_decision(snapshot)
    bound: Bound | None = None
    if handed is None and not engine.alone and _shares_gpus(facts, opts, launcher.kind,
                                                            described):
        bound = _bind_gpus(facts, opts, snapshot)
        facts = bound.facts
        if bound.confined and opts.probe != "never":
            opts = replace(opts, probe="never")
    elif launcher.kind != "slurm":  # srun binds GPUs per task: compared when the job decides
        _check_processes_fit(facts, opts)
    if handed is None and not opts.dry_run:
        _check_no_train_fault(snapshot)
    if handed is not None:  # a worker of `resilient-strategy run`: the decision is made
        opts = handed_options(opts, handed)
        opts, agreed = handed_memory(opts, handed)
        decision = _handed_decision(facts, opts, handed, agreed)
    else:
        decision = _agreed_decision(facts, opts, snapshot if bound is None
                                    else bound.decide_env(snapshot),
                                    prober, engine.clock or prober.clock,
                                    progress_line_for(opts),
                                    startup_check=prober.starts_processes, alone=engine.alone)
    p, results = decision.plan, decision.results
    chosen = _chosen_or_raise(p, opts)
    to_set = _variables(facts, chosen, opts, snapshot, bound)
    _guard(facts, opts.framework, to_set)
    # Decided on a described environment (env=): nothing of this process is changed.
    applied = not opts.dry_run and env is None
    if applied:
        to_set = machine_env.apply(to_set)
    p = _with_call_events(p, opts, launcher, snapshot, bound, chosen)
    sel = Selection(
        candidate=chosen, plan=p, facts=facts, env=to_set, env_applied=applied, results=results,
        from_cache=decision.from_cache, proven=decision.proven, launch=opts.launch,
        process_group_timeout=opts.process_group_timeout, checkpoint_async=opts.checkpoint_async,
        precision=opts.precision, logical_cpus=opts.logical_cpus, dry_run=opts.dry_run,
        tf_workers=opts.tf_workers, tf_worker_rank=opts.tf_worker_rank,
        bound_ordinal=None if bound is None or bound.binding.kind == "shared"
        else bound.binding.ordinals[opts.local_rank],
        decided_in_s=time.perf_counter() - t0,
        advise=_advice(facts, opts, results, chosen), simulated=opts.simulated,
        progress=None if handed is None else _reporter(handed, opts, chosen, snapshot),
        rerank=_reranker(facts, opts, results, p.reference_replicas),
    )
    _warn(sel, opts, handed is None)
    return sel


def _chosen_or_raise(p: Plan, opts: Options) -> Candidate:
    """The plan's choice; none is a typed error (the model fits no candidate, or none works)."""
    if p.chosen is None:
        short = _memory_shortfalls(p)
        if short:
            raise ModelDoesNotFitError(opts.framework, [failure_cause(r) for r in p.ruled_out],
                                       short, _offload_would_fit(p))
        raise NoWorkingStrategyError(opts.framework, [failure_cause(r) for r in p.ruled_out])
    return p.chosen


def _variables(facts: Facts, chosen: Candidate, opts: Options, snapshot: Mapping[str, str],
               bound: Bound | None) -> dict[str, str]:
    """The variables the choice sets here: never the user's, never a bound rank's GPUs, with
    the values of this node between nodes."""
    to_set = _env_to_set(facts, chosen, opts, snapshot)
    if bound is not None and bound.binding.kind != "shared":
        to_set.pop("CUDA_VISIBLE_DEVICES", None)  # each rank keeps the GPUs it was bound to
    if opts.launch.multi_node:  # per-node values (the interface routing to the master)
        from ..nodes.routes import between_nodes

        # a described machine's route is its own fact, never this host's routing table
        route = ((facts.platform.master_ifname or None, "the described machine's master_ifname")
                 if opts.simulated else None)
        to_set = between_nodes(chosen.backend, to_set, snapshot, route)
    return to_set


def _with_call_events(p: Plan, opts: Options, launcher: Launcher, snapshot: Mapping[str, str],
                      bound: Bound | None, chosen: Candidate) -> Plan:
    """The plan with what this call saw first (the framework, the launcher, the GPUs bound)
    and a batch no device takes last (in the trace and the warnings)."""
    seen = LauncherSeen(launcher.kind, opts.rank, opts.local_rank, opts.world_size,
                        opts.local_world_size, snapshot.get("MASTER_ADDR"),
                        _port(snapshot.get("MASTER_PORT")), tuple(sorted(launcher.derived)),
                        launcher.job_id)
    bound_events: tuple[Event, ...] = () if bound is None else (bound.event,)
    if bound is not None and bound.confined:
        bound_events += (Note("gpus_confined", (
            "Each task sees only its own GPU (cgroup confinement): no probe started here can "
            "reach the other tasks' GPUs, so the collective between them is chosen unproven "
            "(probe='never'); under `resilient-strategy run` a collective that fails mid-run "
            "steps down.")),)
    p = replace(p, events=(FrameworkPicked(opts.framework, opts.framework_reason), seen,
                           *bound_events, *p.events))
    big = batch_notice(chosen)  # a batch no device takes: said, in the trace and the warnings
    if big is not None:
        p = replace(p, events=(*p.events, Note("batch_implausible", big)),
                    warnings=(*p.warnings, big))
    return p


def _warn(sel: Selection, opts: Options, deciding_here: bool) -> None:
    """The plan's warnings, one short line each, and the fallback warning where this process
    decided (under `resilient-strategy run` the supervisor announced it, in the same words)."""
    p, chosen = sel.plan, sel.candidate
    for w in p.warnings:  # one short line each: the whole text is in sel.explain(verbose=True)
        log.warning("resilient_strategy: %s", brief(w, WARNING_CHARS, more=WARNING_MORE))
    if opts.launch.rank == 0 and opts.tf_worker_rank == 0 and not opts.dry_run and deciding_here:
        fell = fallback_warning(p, sel.results, sel.facts, opts, chosen)
        if fell:
            log.warning("resilient_strategy: %s", fell)
    log.info("resilient_strategy: chose %s in %.2f s", chosen.label, sel.decided_in_s)


def _check_no_train_fault(env: Mapping[str, str]) -> None:
    """A rehearsed mid-run fault means nothing outside `resilient-strategy run`: say so rather
    than train as if it were armed."""
    from ..records.trainfault import FAULT_VAR as TRAIN_FAULT_VAR

    if env.get(TRAIN_FAULT_VAR, "").strip():
        raise InvalidOptionError(
            f"{TRAIN_FAULT_VAR} is set, but this process is not a worker of `resilient-strategy "
            "run` (it rehearses a mid-run fault for the supervisor): run the script with "
            "`resilient-strategy run`, or unset the variable", TRAIN_FAULT_VAR)


def _memory_shortfalls(p: Plan) -> list[MemoryShortfall]:
    """The memory table of a plan that ruled candidates out for memory (else empty): every row
    the memory steps wrote (the chain's, the fewer-GPU step-down's, the offloaded ones')."""
    if not any(r.rule == "memory" for r in p.ruled_out):
        return []
    rows: dict[tuple[str, str], MemoryRow] = {}
    for e in p.events:
        if isinstance(e, (MemoryChecked, FewerDevices)):
            rows.update({(r.candidate.key, r.where): r for r in e.rows})
        elif isinstance(e, OffloadConsidered):
            rows.update({(r.candidate.key, r.where): r for pair in e.rows for r in pair})
    return [MemoryShortfall(r.candidate.label, r.candidate.key, r.need_bytes, r.free_bytes,
                            r.usable_bytes, r.shards, r.where) for r in rows.values()]


def _offload_would_fit(p: Plan) -> bool:
    """The plan found that offloading would fit, where the user did not allow it."""
    return any(isinstance(e, OffloadConsidered) and e.mode != "auto" and e.would_fit
               for e in p.events)


def _advice(
    facts: Facts, opts: Options, results: Mapping[str, ProbeResult], chosen: Candidate
) -> Callable[[int], str | None] | None:
    """When the decision assumed a model size, a check of the real one (at ``prepare``)."""
    if opts.gradient_bytes is not None or opts.dry_run:
        return None

    def advise(gradient_bytes: int) -> str | None:
        if gradient_bytes <= 0:
            return None
        p = plan(facts, opts.rules, results, replace(opts, gradient_bytes=gradient_bytes))
        better = p.chosen or p.next_probe
        if better is None or better.key == chosen.key:
            return None
        est = {r.candidate.key: r.estimate.step_seconds for r in p.ranked}
        then = f" (~{human_duration(est[chosen.key])})" if chosen.key in est else ""
        return (
            f"the model's gradients are {human_bytes(gradient_bytes)}; with that figure "
            f"{better.label} (~{human_duration(est.get(better.key, 0.0))} per global batch"
            f"{'' if p.chosen else ', once its probe passes'}) would beat the chosen "
            f"{chosen.label}{then}. Pass gradient_bytes={gradient_bytes} (or model=) to "
            "resilient_strategy() to let it choose by the real size."
        )

    return advise


def _reranker(
    facts: Facts, opts: Options, results: Mapping[str, ProbeResult], reference: int
) -> Callable[[MeasuredStep, int, int | None], Plan] | None:
    """The planner again, for the user's step measured during training (issue 41): the same
    facts, rules and probe results, the measured compute (``measured=``), the model's real
    gradient bytes and, where none was given, the global batch it trained with."""
    if opts.dry_run:
        return None

    def rerank(measured: MeasuredStep, gradient_bytes: int, global_batch: int | None) -> Plan:
        o = opts if gradient_bytes <= 0 else replace(opts, gradient_bytes=gradient_bytes)
        if o.global_batch_size is None and global_batch:
            o = replace(o, global_batch_size=global_batch)
        return plan(facts, o.rules, results, o, reference_replicas=reference, measured=measured)

    return rerank


def _check_processes_fit(facts: Facts, opts: Options) -> None:
    """More torch processes on this node than GPUs it can see is the launch's mistake, not a
    machine to train on fewer GPUs: the ranks past the last GPU fail with 'invalid device
    ordinal' (or share a GPU). Said as a typed error naming the fix, before anything runs."""
    if opts.framework != "torch" or opts.world_size <= 1 or not facts.framework("torch").cuda:
        return
    local = opts.world_size // max(1, opts.nodes)
    gpus = len(facts.gpus)  # visible to the job (devices= may ask for fewer on purpose)
    if any(g.mig_enabled for g in facts.gpus):
        return  # MIG: no process group spans MIG instances; rank 0 trains on one slice
        # with accumulation, the others exit (the planner's mig_one_slice)
    if 0 < gpus < local:
        shown = facts.visibility.raw
        seen = f" (CUDA_VISIBLE_DEVICES={shown})" if shown else ""
        raise InvalidOptionError(
            f"The launcher started {local} processes on this node but only {gpus} GPU(s) are "
            f"visible{seen}: the ranks past GPU {gpus - 1} would fail with 'invalid device "
            f"ordinal' or share a GPU. Start the job with --nproc_per_node {gpus} (or make "
            f"{local} GPUs visible).", "LOCAL_WORLD_SIZE")


def _port(text: str | None) -> int | None:
    return int(text) if text and text.isdigit() else None


@dataclass(frozen=True)
class Bound:
    """The GPUs every local rank sees, agreed before the decision: the `Binding`, the facts to
    plan on (the node's GPUs, one per local rank in rank order, where the ranks were bound to
    GPUs of their own; this rank's own facts where every rank sees the same), and its event."""

    binding: Binding
    facts: Facts
    event: GpusBound
    #: the tasks' GPUs are confined (cgroups: each task's NVML lists only its own GPUs, so two
    #: ranks' GPUs share an NVML index): no process can reach another task's GPU, so no probe
    #: worker started by local rank 0 can prove a collective across them
    confined: bool = False

    def decide_env(self, env: Mapping[str, str]) -> dict[str, str]:
        """The environment local rank 0 probes in: the node's GPUs visible by UUID (each task
        was shown only its own), where a process can reach them."""
        if self.binding.kind == "shared" or self.confined:
            return dict(env)
        return {**env, "CUDA_VISIBLE_DEVICES": ",".join(self.binding.trains_on)}


def _shares_gpus(facts: Facts, opts: Options, launcher: str, described: bool) -> bool:
    """Whether the local ranks tell each other which GPUs they see before deciding: PyTorch,
    several processes on this node, GPUs seen, not a dry run. A described torchrun launch (a
    test planning one rank of a launch on described facts) keeps planning on its own GPUs, as
    before; a described srun task shares them like a real one (tests start one per rank)."""
    local = opts.local_world_size or opts.world_size
    return (opts.framework == "torch" and opts.world_size > 1 and local > 1
            and bool(facts.gpus) and bool(facts.framework("torch").cuda) and not opts.dry_run
            and (launcher == "slurm" or not (described or opts.simulated)))


def _bind_gpus(facts: Facts, opts: Options, env: Mapping[str, str]) -> Bound:
    """Every local rank's GPUs (by UUID) shared through the agreement's directory, each rank's
    GPU picked from them (`core.values.binding.bind`), two ranks on one physical GPU refused."""
    from dataclasses import asdict

    from ..nodes.onenode import GpuExchange

    local = opts.local_world_size or opts.world_size
    exchange = GpuExchange.for_job(env, opts.cache_dir, opts.local_rank, local)
    shared = exchange.share([asdict(g) for g in facts.gpus], opts.budget_s + 60.0)
    per_rank = [Facts.from_dict({"gpus": g}).gpus for g in shared]
    binding = bind([tuple(g.uuid or f"ordinal-{g.index}" for g in gs) for gs in per_rank])
    event = GpusBound(binding.kind, binding.seen, binding.trains_on,
                      binding.ordinals[opts.local_rank])
    if binding.unbound and all(u.startswith("MIG-") for s in binding.seen for u in s):
        # MIG instances: no process group spans them, so nothing is shared between ranks
        # here: rank 0 trains on its slice with accumulation (the planner's mig_one_slice),
        # the others exit 0, never two ranks training on one slice
        return Bound(binding, replace(facts, env=relevant_env(dict(facts.env))), event)
    if binding.unbound:
        twice = ", ".join(f"{u} (local ranks {', '.join(map(str, r))})"
                          for u, r in binding.shared.items())
        distinct = len({u for s in binding.seen for u in s})
        raise InvalidOptionError(
            f"{local} processes on this node see {distinct} distinct GPU(s) between them "
            f"({twice or 'none'}): local rank(s) {', '.join(map(str, binding.unbound))} would "
            f"share a physical GPU with another rank. Bind one GPU per task (srun "
            f"--gpus-per-task=1, or as many GPUs as tasks per node), or start at most "
            f"{distinct} process(es) per node.", "CUDA_VISIBLE_DEVICES")
    if binding.kind == "shared":  # the relevant environment only, as detect_facts keeps it
        return Bound(binding, replace(facts, env=relevant_env(dict(facts.env))), event)
    node_gpus = tuple(replace(next(g for g in per_rank[r] if (g.uuid or f"ordinal-{g.index}")
                                   == u), index=r)
                      for r, u in enumerate(binding.trains_on))
    # links between GPUs of different processes are not this process's to read: none known
    # and the ranks' own CUDA_VISIBLE_DEVICES left out: every rank plans (and names the
    # agreement by) the same node, whatever each one's variable says
    node = replace(facts, gpus=node_gpus, links=(), fabric=None,
                   env=tuple(kv for kv in relevant_env(dict(facts.env))
                             if kv[0] != "CUDA_VISIBLE_DEVICES"),
                   visibility=Visibility(physical=tuple(g.physical_index for g in node_gpus)))
    physical = [g.physical_index for g in node_gpus if g.physical_index >= 0]
    return Bound(binding, node, event, confined=len(set(physical)) < len(physical))


def _check_visibility(facts: Facts) -> None:
    from ..machine.visible import visible_problem

    problem = visible_problem(facts.visibility, has_gpus=facts.nvml_error is None)
    if problem:
        raise InvalidVisibleDevicesError(facts.visibility.raw or "", problem)


GPU_FRAMEWORKS = FRAMEWORKS


def _guard(facts: Facts, framework: str, to_set: Mapping[str, str]) -> None:
    from ..machine.guard import check_visible_devices_settable

    if "CUDA_VISIBLE_DEVICES" in to_set:
        # CUDA reads the variable once per process, whichever framework starts it first.
        check_visible_devices_settable(
            facts, GPU_FRAMEWORKS, to_set["CUDA_VISIBLE_DEVICES"], facts.visibility.raw
        )
    info = facts.framework(framework)
    if info.imported and not info.gpu_initialized:
        where = f" at {info.imported_at}" if info.imported_at else ""
        log.info("resilient_strategy: %s was imported%s before the selection; it has not "
                 "initialized GPUs yet, so that is fine", framework, where)


# --------------------------------------------------------------------------------------------
# One decision per node under a launcher
# --------------------------------------------------------------------------------------------
def _agreed_decision(
    facts: Facts, opts: Options, env: Mapping[str, str], prober: Prober,
    clock: Callable[[], float], progress: ProgressLine | None = None,
    startup_check: bool = False,
    alone: bool = False,
) -> Decision:
    """Under torchrun, local rank 0 decides (and probes); the other ranks wait for its results
    and re-plan from them, so every rank reaches the same choice (no split brain). ``alone``:
    the launch is only planned (the command line's ``--nproc-per-node``): no other rank exists,
    so nothing is published for them."""
    launch = opts.launch
    if opts.multi_worker and not opts.dry_run:
        from ..nodes.tfworkers import decide_across_workers

        p, results, proven = decide_across_workers(
            facts, opts, env, prober, clock,
            functools.partial(decide, progress=progress, startup_check=startup_check))
        return Decision(p, results, False, proven)
    if not launch.launched or opts.dry_run or alone:
        return decide(facts, opts, env, prober, clock, progress, startup_check)
    if launch.multi_node and opts.framework == "torch":
        if opts.simulated:  # described outcomes speak for the whole job: no store, no network
            return decide(facts, opts, env, prober, clock, progress, startup_check,
                          cross_node=True)
        from ..nodes.manynodes import agreed_decision

        return agreed_decision(
            facts, opts, env, prober, clock,
            functools.partial(decide, progress=progress, startup_check=startup_check))
    from ..nodes.onenode import Agreement

    # with no GPU seen, each rank's own CUDA_VISIBLE_DEVICES (srun --gpus-per-task on a node
    # whose GPUs this build or driver cannot use) changes nothing the ranks decide on
    # (and of a described machine, the relevant variables only, as detect_facts keeps them)
    named = replace(facts, env=tuple(kv for kv in relevant_env(dict(facts.env))
                                     if facts.gpus or kv[0] != "CUDA_VISIBLE_DEVICES"))
    agreement = Agreement.for_job(env, named.fingerprint(), opts.cache_dir)
    deadline_s = opts.budget_s + 60.0
    if launch.local_rank == 0:
        d = decide(facts, opts, env, prober, clock, progress, startup_check)
        written = agreement.publish(
            {"chosen": d.chosen.key if d.chosen else None,
             "results": {k: v.to_dict() for k, v in d.results.items()},
             "from_cache": d.from_cache, "proven": d.proven}
        )
        if written is not None and written != agreement.path:  # the cache's disk refused it
            d = replace(d, plan=replace(d.plan, events=(*d.plan.events, Note(
                "agreement_moved",
                f"The decision was shared with the other local ranks through {written.parent}: "
                f"{agreement.path.parent} (the cache directory) is not writable (full or "
                "read-only)."))))
        return d
    if opts.framework == "torch" and prober.starts_processes:
        import_while_waiting("torch", "torch.distributed")
    payload = agreement.wait(deadline_s)
    results = {k: ProbeResult.from_dict(v) for k, v in payload["results"].items()}
    p = plan(facts, opts.rules, results, opts)
    if p.next_probe is not None and not payload["proven"]:
        p = replace(p, chosen=p.next_probe, next_probe=None)
    mine = p.chosen.key if p.chosen else None
    if mine != payload["chosen"]:
        raise RanksDisagreeError(launch.rank, mine, payload["chosen"])
    return Decision(p, results, bool(payload["from_cache"]), bool(payload["proven"]))


def import_while_waiting(*modules: str) -> None:
    """A local rank that waits for local rank 0's decision imports the framework it trains with
    meanwhile: its script imports it right after the decision, so the import is paid while rank
    0 probes rather than after (rank 0 imported it to fork its probe workers from itself,
    `probing.forkserver.fork_here`). Importing starts no GPU: ``CUDA_VISIBLE_DEVICES`` and
    ``NCCL_*`` are applied after the wait, as before. A framework that does not import is left
    to the runtime, which raises the error the user acts on."""
    import importlib

    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:  # reported by the runtime's own import later
            log.debug("importing %s while waiting for the decision: %s", name, exc)
            return


# --------------------------------------------------------------------------------------------
# A decision handed down by `resilient-strategy run`
# --------------------------------------------------------------------------------------------
def handed_options(opts: Options, handed: HandedDecision) -> Options:
    """Under ``resilient-strategy run`` the handoff is the one source of the decided values: the
    global batch the supervisor planned with (``--global-batch-size``) is the one this worker
    trains; a script that passes another is an error naming both (never a silent second truth).
    """
    want = handed.global_batch_size
    if want is None or opts.global_batch_size == want:
        return opts
    if opts.global_batch_size is None:
        return replace(opts, global_batch_size=want)
    raise InvalidOptionError(
        f"`resilient-strategy run --global-batch-size {want}` decided for a global batch of "
        f"{want}, but this script passes resilient_strategy(global_batch_size="
        f"{opts.global_batch_size}); pass the same value to both, or drop one of them",
        "global_batch_size")


def handed_memory(opts: Options, handed: HandedDecision) -> tuple[Options, tuple[str, ...]]:
    """The sharding and offload the supervisor planned with (``--sharding`` / ``--offload``,
    or their defaults) are the ones this worker trains with. A script that passes another
    value than the default is an error naming both (``resilient-strategy run`` cannot see the
    script's arguments: the flag must say it); a script that passes the default takes the
    supervisor's value, said in the trace and the log (the returned notes)."""
    notes: list[str] = []
    for name, default in (("sharding", "auto"), ("offload", "none")):
        want = getattr(handed, name)
        mine = getattr(opts, name)
        if want is None or mine == want:
            continue
        flag = next((f for f in handed.flags if f.startswith(f"--{name} ")), None)
        if mine != default:
            where = f"`resilient-strategy run {flag}`" if flag else (
                f"`resilient-strategy run` (--{name} not given: {want!r})")
            raise InvalidOptionError(
                f"{where} decided with {name}={want!r}, but this script passes "
                f"resilient_strategy({name}={mine!r}); pass --{name} {mine} to "
                "`resilient-strategy run`, or the same value to both", name)
        given = flag or f"--{name} {want}"
        notes.append(f"{name}={want!r} from `resilient-strategy run {given}` (this script "
                     f"passes the default, {default!r}).")
        opts = replace(opts, **{name: want})
    for note in notes:
        log.info("resilient_strategy: %s", note)
    return opts, tuple(notes)


def _handed_decision(facts: Facts, opts: Options, handed: HandedDecision,
                     agreed: tuple[str, ...] = ()) -> Decision:
    """Re-plan from the supervisor's results (milliseconds, no probe) and take its candidate,
    with this script's own batch and model figures: every rank agrees by construction. A
    decision bound to a subset of the GPUs is read in this worker's numbering (its GPUs 0..k-1
    are the ones it is bound to)."""
    supervisor_key = handed.chosen
    try:
        handed = handed.renumbered()
    except ValueError as exc:
        raise ResilientStrategyError(f"`resilient-strategy run`: {exc}") from None
    facts = handed.planned_memory(facts)  # the memory the supervisor planned against
    results = dict(handed.results)
    # the batch split of the supervisor's plan (the job's per-device batch, accumulating on
    # fewer replicas), not of this worker's own launch (one process trains it all at once):
    # planned so, the trace, the ranked candidates and the chosen one all say what trains
    p = plan(facts, opts.rules, results, opts, reference_replicas=handed.reference_replicas)
    found = [c for c in (*p.candidates, *([p.next_probe] if p.next_probe else []))
             if c.key == handed.chosen]
    resolved = ""
    if not found:  # the supervisor planned the model's memory otherwise: its decision trains
        handed_key = CandidateKey.read(handed.chosen)
        sharded = handed_key is not None and handed_key.sharded
        offload = handed_key is not None and handed_key.offload
        found = [replace(c, sharded=sharded, offload=offload) for c in p.candidates
                 if replace(c, sharded=sharded, offload=offload).key == handed.chosen]
        if found:
            resolved = (
                f"This script's own figures planned {found[0].label} otherwise (sharded or "
                "offloaded), from other model sizes than `resilient-strategy run`'s: the "
                "supervisor's decision trains; pass --param-bytes (and "
                "--optimizer-state-factor) to `resilient-strategy run` to plan with the "
                "script's figures.")
            log.warning("resilient_strategy: %s", resolved)
    if not found or opts.framework != handed.framework:
        raise ResilientStrategyError(
            f"`resilient-strategy run` chose {handed.chosen} ({handed.framework}), which this "
            f"script's resilient_strategy(framework={opts.framework!r}, ...) cannot "
            "train on here; pass --framework to `resilient-strategy run` to match the script")
    chosen = found[0]
    # the worker's own plan may end in another choice or probe: the handed one replaces them
    events = [e for e in p.events if not isinstance(e, (Chosen, NextProbe))]
    if handed.launched_by:  # who started the supervisor (srun): its trace says so
        events.append(Note("run_launcher", handed.launched_by))
    events += [Note("multi_node", n) for n in handed.node_trace]
    events += [Note("relaunched", n) for n in handed.notes]
    events += [Note("handed_memory", n) for n in agreed]
    if resolved:
        events.append(Note("handed_memory", resolved))
    if handed.devices:
        events.append(Note("bound_devices", (
            f"Bound by `resilient-strategy run` to GPUs {','.join(map(str, handed.devices))} "
            f"of its machine ({supervisor_key}): CUDA_VISIBLE_DEVICES={handed.visible_devices}, "
            f"this worker's GPUs {','.join(map(str, range(len(handed.devices))))}.")))
    events.append(Note("handed_down", (
        f"Chose {chosen.label}: decided by `resilient-strategy run` before the workers started "
        f"(launch attempt {handed.attempt + 1}).")))
    p = replace(p, chosen=chosen, next_probe=None, events=tuple(events))
    return Decision(p, results, handed.from_cache, handed.proven)


def _reporter(handed: HandedDecision, opts: Options, chosen: Candidate,
              env: Mapping[str, str]) -> TrainingReporter:
    from ..records.handoff import reporter_for

    # with several replicas the last micro-step's backward (torch) or the train step (Keras)
    # reduces gradients across them: reported as a collective
    return reporter_for(handed, opts.launch.rank, opts.launch.local_rank, chosen.backend,
                        chosen.num_replicas, env)
