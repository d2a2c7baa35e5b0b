"""One decision's bounded loop: plan, prove the next candidate (or reuse what the cache knows),
plan again, until the planner chooses; and what a mid-run failure may leave in the cache.

`decide` is the seam the executor (``resilient_strategy()``), the supervisor and the
testing kit's replay all use; nothing here applies an environment or builds a runtime.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING

from ..core.call.options import Options
from ..core.knowledge.causes import CAUSES, LAUNCH_CAUSES, RETRY_AFTER_CHECK_CAUSES
from ..core.measures.memory import model_memory
from ..core.measures.probe import (
    ENVIRONMENTAL_CAUSES,
    ERROR,
    TIMEOUT,
    ProbeResult,
    ProbeSpec,
    judged_hang,
)
from ..core.planning.plan import Candidate, RuledOut, plan
from ..core.planning.shapes import Plan
from ..core.trace.choosing import Chosen
from ..core.trace.event import Event, Note
from ..core.trace.inputs import CachedFailure
from ..core.values.facts import Facts
from ..core.values.human import human_bytes
from ..errors import (
    FailureCause,
    GpuUnusableError,
    LaunchFaultError,
    NoSpaceError,
    ResilientStrategyError,
)
from ..probing.base import ProbeFn, Prober, as_prober
from ..vocab import MULTI_WORKER_BACKENDS
from .cache import CachedResult, DecisionCache
from .notices import (
    ProgressLine,
    Startup,
    reclassify_short_timeout,
    short_timeout_warning,
    startup_floor,
)

if TYPE_CHECKING:
    from types import ModuleType

    from ..probing.health import Unproven

from ..core.planning.decision import Decision as Decision  # re-exported: the deciders' one shape

log = logging.getLogger("resilient_strategy")

#: A prober that defers the GPU health check to the decision (``defers_gpu_check``:
#: `probing.prober.DeferredHealthProber`, the testing kit's SimulatedProber) is asked
#: ``check_gpus(framework, devices, env)`` -> the broken GPUs with why; one that does not
#: checks after each killed probe itself.
GpuCheck = Callable[[str, tuple[int, ...], Mapping[str, str]], list[tuple[int, str]]]
#: The workers' fault injection (probing/workers/common.py): its results are never cached.
FAULT_VAR = "RESILIENT_STRATEGY_PROBE_FAULT"
MAX_ROUNDS = 32  # probes per decision, at most (the candidate set is far smaller)




# --------------------------------------------------------------------------------------------
# Deciding
# --------------------------------------------------------------------------------------------
#: DDP's default gradient bucket; a model's largest bucket is at most this (or its largest
#: tensor, which the total gradient size bounds from above).
DDP_BUCKET_BYTES = 25 << 20
#: The largest sharding unit a sharded probe checks at (the workers' own cap).
MAX_UNIT_CHECK_BYTES = 256 << 20


def spec_for(c: Candidate, opts: Options, timeout_s: float) -> ProbeSpec:
    grad = opts.gradient_bytes
    check: tuple[int, ...] = (min(grad, DDP_BUCKET_BYTES),) if grad else ()  # largest bucket
    mem = model_memory(opts) if c.sharded else None
    if mem is not None:  # FSDP2 gathers (and reduce-scatters) one unit at a time
        check += (min(mem.unit_bytes, MAX_UNIT_CHECK_BYTES),)
    return ProbeSpec(
        candidate=c.key,
        framework=c.framework,
        backend=c.backend,
        devices=c.devices,
        env=c.env,
        world_size=c.num_replicas if c.framework == "torch" else 1,
        timeout_s=timeout_s,
        logical_cpus=opts.logical_cpus,
        check_bytes=check,
        workers=opts.tf_workers if c.backend in MULTI_WORKER_BACKENDS else 1,
        worker_rank=opts.tf_worker_rank if c.backend in MULTI_WORKER_BACKENDS else 0,
        sharded=c.sharded,
    )


def decide(
    facts: Facts,
    opts: Options,
    env: Mapping[str, str],
    prober: Prober | ProbeFn,
    clock: Callable[[], float] = time.monotonic,
    progress: ProgressLine | None = None,
    startup_check: bool = False,
    max_rounds: int = MAX_ROUNDS,
    known: Mapping[str, ProbeResult] | None = None,
    *,
    cross_node: bool = False,
) -> Decision:
    """Plan, probing as needed (at most ``max_rounds`` probes).

    The probe budget is one deadline for the whole decision; each probe also has its own.
    ``known``: results that override the cache's (a supervisor's mid-run failures).
    ``progress`` hears each probe start and end (the one hook for what a user sees meanwhile).
    ``startup_check`` (real probes only: a simulation has no start-up to measure) warns when the
    timeout is below what a probe needs to start here, and calls a probe it cut short so.
    ``cross_node``: ``prober`` proves candidates across every node (`multinode`).
    """
    prober = as_prober(prober)
    multi_node = opts.framework == "torch" and opts.nodes > 1
    fingerprint = facts.fingerprint()
    cache, results, notes = _from_cache(opts, env, fingerprint, multi_node)
    cached_keys = set(results)
    results.update(known or {})
    startup = startup_floor(opts.framework, results)
    warned = False
    deadline = clock() + opts.budget_s
    fresh: dict[str, ProbeResult] = {}
    check: GpuCheck | None = prober.check_gpus if prober.defers_gpu_check else None
    unproven: Unproven = _health().Unproven()
    retried: list[Event] = []  # candidates probed once more after a GPU check (RETRY_AFTER_...)
    p = plan(facts, opts.rules, results, opts)
    for _ in range(max_rounds):
        if (p.next_probe is None or opts.probe == "never" or opts.dry_run
                or (multi_node and not cross_node)):
            break
        c = p.next_probe
        if c.key in results:  # cannot happen with a sound planner; never loop on it
            raise ResilientStrategyError(f"planner asked to probe {c.key} twice")
        # the final health check of GPUs a killed probe left unproven always runs: its cost is
        # kept out of what the next probe may spend, so the decision ends within its budget
        reserve = (_check_cost(prober, c.framework, len(unproven.gpus), env)
                   if check is not None else 0.0)
        left = deadline - clock() - reserve
        timeout_s = min(opts.timeout_s, left)
        if startup_check and not warned:
            warned = _warn_short_timeout(opts, startup)
        res = _probe(c, opts, env, prober, left, timeout_s, startup_check, startup, progress)
        if (res.cause in RETRY_AFTER_CHECK_CAUSES or res.cause == STATUS_LOST) \
                and deadline - clock() > 1.0:
            # no verdict on the candidate yet: its GPUs checked (not for a status another
            # reaper took: nothing speaks against them), then the same probe once more
            res = _retry_after_check(c, res, opts, env, prober,
                                     None if res.cause == STATUS_LOST else check, unproven,
                                     deadline, clock, startup_check, startup, tuple(results),
                                     retried, progress)
        _after_probe(c, res, opts, env, prober, check, unproven, timeout_s, deadline, clock,
                     tuple(results))
        results[c.key] = res
        # never probed, or cut short before it could start: nothing learned about the machine
        if res.cause not in ("budget", "timeout_short"):
            fresh[c.key] = res
        p = plan(facts, opts.rules, results, opts)
    unchecked: list[Event] = []
    if check is not None and unproven.gpus:
        unchecked = _final_check(prober, check, unproven, p.chosen or p.next_probe, opts, env,
                                 deadline - clock(), tuple(results))
    if cache is not None and fresh:
        cache.store(fingerprint, fresh)
    proven = p.next_probe is None
    p = _finished(p, opts, notes, unchecked, retried, multi_node and not cross_node, max_rounds)
    # "from the cache": nothing was probed now, and a cached result shaped this plan
    used = {r.candidate.key for r in p.ranked} | {r.candidate.key for r in p.ruled_out}
    return Decision(p, results, not fresh and bool(cached_keys & used), proven)


def _finished(p: Plan, opts: Options, notes: list[Event], unchecked: list[Event],
              retried: list[Event], one_node_only: bool, max_rounds: int) -> Plan:
    """The last plan with the decision's own events, and its next candidate chosen unproven
    when probing stopped before it (``one_node_only``: a multi-node job with no prober across
    the nodes)."""
    if notes or unchecked or retried:  # the cache's notes before the plan they shaped; after
        # its own events, the GPUs the deferred check left out and the candidates probed again
        p = replace(p, events=(*notes, *p.events, *unchecked, *retried))
    if p.next_probe is not None:  # probing off, or a dry run: the next candidate, unproven
        how = ("dry_run" if opts.dry_run else "multi_node" if one_node_only
               else "probing_off" if opts.probe == "never" else "rounds_spent")
        p = replace(p, chosen=p.next_probe, next_probe=None,
                    events=(*p.events, Chosen(p.next_probe, how, max_rounds=max_rounds)))
    return p


def _warn_short_timeout(opts: Options, startup: Startup) -> bool:
    """Warn when the timeout is below what a probe needs to start here; True (warned once)."""
    short = short_timeout_warning(opts.timeout_s, startup, opts.framework)
    if short:
        log.warning("resilient_strategy: %s", short)
    return True


def _from_cache(opts: Options, env: Mapping[str, str], fingerprint: str, multi_node: bool
                ) -> tuple[DecisionCache | None, dict[str, ProbeResult], list[Event]]:
    """The cache this decision reads and writes (None: none), the results it trusts, and the
    notes on what it was trusted with."""
    # Multi-node: a node's cache cannot speak for the links between nodes; without a prober
    # that spans the nodes (cross_node), no probe on one node may sway the choice either. The
    # same holds for the workers of a TF_CONFIG job (their probes span the workers themselves).
    cache = DecisionCache(opts.cache_dir, opts.cache_ttl_s) \
        if opts.cache_dir and not multi_node and not opts.multi_worker else None
    results: dict[str, ProbeResult] = {}
    notes: list[Event] = []
    fault = env.get(FAULT_VAR, "").strip()
    if cache is not None and fault:  # a rehearsal must never change a later real decision
        cache = None
        notes.append(Note("fault_injection", f"Fault injection is on ({FAULT_VAR}={fault}): the "
                          "cache is neither read nor written."))
    if cache is not None and opts.probe != "force" and cache.usable():
        # "never" still learns from the cache, failures seen once included: nothing re-proves
        trusted, notes_ = trusted_results(cache.entries(fingerprint), opts.probe != "never")
        results.update(still_valid(trusted, opts.timeout_s))
        notes += notes_
    return cache, results, notes


def _probe(c: Candidate, opts: Options, env: Mapping[str, str], prober: Prober, left: float,
           timeout_s: float, startup_check: bool, startup: Startup,
           progress: ProgressLine | None) -> ProbeResult:
    """One probe of ``c`` within ``timeout_s`` (none when the budget has ``left`` no more than a
    second), told to ``progress``."""
    if progress is not None:
        progress.start(c, timeout_s)
    if left <= 1.0:
        res = ProbeResult(c.key, ERROR, 0.0, "budget",
                          f"the probe budget of {opts.budget_s:g} s is spent")
    else:
        res = prober(spec_for(c, opts, timeout_s), env)
        if startup_check:
            res = reclassify_short_timeout(res, timeout_s, startup, opts.framework)
            res = space_short(res, temp_root(env))
    if progress is not None:
        progress.end(res)
    return res


def _after_probe(c: Candidate, res: ProbeResult, opts: Options, env: Mapping[str, str],
                 prober: Prober, check: GpuCheck | None, unproven: Unproven, timeout_s: float,
                 deadline: float, clock: Callable[[], float], probed: tuple[str, ...]) -> None:
    """What a probe's result ends at once: a full disk or a launch fault (every candidate would
    meet it), or the GPUs a hang left unproven checked before any other variant runs there."""
    if res.cause == NO_SPACE:
        raise no_space_error(c, res, temp_root(env))
    if res.cause in LAUNCH_CAUSES:  # every candidate would meet it: no fallback, no cache
        raise launch_fault_error(c, res)
    if check is not None and res.cause not in ("budget",):
        spec = spec_for(c, opts, timeout_s)
        due = unproven.after_probe(spec, res, _check_fits(
            prober, c.framework, len(_health().gpus_of(spec)), env, deadline - clock()))
        if due:  # the first hang, or a failure before its devices were ready on a GPU a
            # killed probe left: checked before any other variant runs on those GPUs
            _check_or_raise(check, c.framework, due, env, unproven,
                            f"the probe of {c.key} hung or failed", (*probed, c.key))


def _retry_after_check(c: Candidate, first: ProbeResult, opts: Options, env: Mapping[str, str],
                       prober: Prober, check: GpuCheck | None, unproven: Unproven,
                       deadline: float, clock: Callable[[], float], startup_check: bool,
                       startup: Startup, probed: tuple[str, ...], retried: list[Event],
                       progress: ProgressLine | None) -> ProbeResult:
    """A probe whose cause is no verdict by itself (`RETRY_AFTER_CHECK_CAUSES`: NCCL out of
    GPU memory while setting up): its GPUs are health-checked where the check fits the budget
    (a broken one is a `GpuUnusableError`, as after a hang), then the same candidate is probed
    once more and that second result stands. The trace says both."""
    gpus = _health().gpus_of(spec_for(c, opts, opts.timeout_s))
    checked = ()
    if check is not None and gpus and _check_fits(prober, c.framework, len(gpus), env,
                                                  deadline - clock()):
        _check_or_raise(check, c.framework, gpus, env, unproven,
                        f"the probe of {c.key} failed ({first.cause})", (*probed, c.key))
        checked = gpus
    left = deadline - clock()
    if left <= 1.0:
        return first
    timeout_s = min(opts.timeout_s, left)
    if progress is not None:
        progress.start(c, timeout_s)
    res = prober(spec_for(c, opts, timeout_s), env)
    if startup_check:
        res = reclassify_short_timeout(res, timeout_s, startup, opts.framework)
    if progress is not None:
        progress.end(res)
    how = (f"GPU(s) {', '.join(map(str, checked))} passed the health check, and "
           if checked else "")
    retried.append(Note("retried_after_check", (
        f"{c.label} failed with '{first.cause}' ({first.why()}), which is no verdict on it by "
        f"itself: {how}it was probed once more: "
        + ("it passed." if res.ok else f"it failed again ({res.cause}).")), ))
    return res


def _health() -> ModuleType:
    """The probing layer's GPU health module, imported when a probe needs it (it starts
    processes: ``import resilient_strategy`` stays free of ``subprocess``)."""
    from ..probing import health

    return health


def _check_or_raise(check: GpuCheck, framework: str, gpus: tuple[int, ...],
                    env: Mapping[str, str], unproven: Unproven, after: str,
                    probed: tuple[str, ...] = ()) -> None:
    """Run the GPU health check on ``gpus``; `GpuUnusableError` naming the broken ones
    (and the candidates ``probed`` before it), else they are proven."""
    broken = check(framework, gpus, env)
    if broken:
        raise GpuUnusableError(broken, after=after, probed=probed)
    unproven.checked(gpus)


def _check_cost(prober: Prober, framework: str, gpus: int, env: Mapping[str, str]) -> float:
    """What a GPU health check of ``gpus`` GPUs typically costs (the prober's estimate:
    its own, or the typical figure of a GPU machine)."""
    return prober.check_seconds(framework, gpus, env) if gpus > 0 else 0.0


def _check_fits(prober: Prober, framework: str, gpus: int, env: Mapping[str, str],
                budget_left_s: float) -> bool:
    """Whether a GPU health check of ``gpus`` GPUs fits what is left of the probe budget."""
    return _check_cost(prober, framework, gpus, env) <= budget_left_s


def _final_check(prober: Prober, check: GpuCheck, u: Unproven, chosen: Candidate | None,
                 opts: Options, env: Mapping[str, str], budget_left_s: float,
                 probed: tuple[str, ...] = ()) -> list[Event]:
    """The deferred GPU health check, once, before the decision returns (see
    `probing.health.Unproven`): the chosen candidate's unproven GPUs always; the other
    unproven GPUs in the same check unless its typical cost would overrun what is left of the
    probe budget, in which case a Note names them and how to check them."""
    framework = chosen.framework if chosen is not None else opts.framework
    every = tuple(sorted(u.gpus))
    # what the check typically costs: the prober's own figure (the testing kit's described
    # machine), else the typical one of a GPU machine (forked from this process)
    seconds = prober.check_seconds(framework, len(every), env)
    affordable = seconds <= budget_left_s
    now, skipped = u.final(chosen.devices if chosen is not None else (), affordable)
    by = ", ".join(u.by)
    if now:
        _check_or_raise(check, framework, now, env, u, f"the hung probe(s) of {by} were killed",
                        probed)
    if not skipped:
        return []
    ids = ",".join(map(str, skipped))
    return [Note("gpus_unchecked", f"GPU(s) {ids} were left unchecked: the hung probe(s) of "
                 f"{by} were killed on them, the chosen strategy does not use them, and their "
                 f"health check would overrun the probe budget ({budget_left_s:.1f} s left). "
                 f"Before anything else uses them, check them: `nvidia-smi -i {ids}` (a GPU "
                 f"that is lost or shows errors needs `nvidia-smi --gpu-reset -i <index>`), or "
                 f"run `python -m resilient_strategy.probing.workers.health_worker --framework "
                 f"{framework} --devices {ids} --report health.json`.")]


#: Below this many free bytes in the temp directory a failed probe is put down to the full disk
#: (its rendezvous and progress files live there: a gloo probe looks hung, a worker dies).
LOW_SPACE_BYTES = 16 << 20


def temp_root(env: Mapping[str, str]) -> str:
    import tempfile

    return env.get("TMPDIR") or tempfile.gettempdir()


def space_short(res: ProbeResult, temp_root: str, free: int | None = None) -> ProbeResult:
    """A failed probe, put down to a full temp directory when ``temp_root`` has less than
    `LOW_SPACE_BYTES` free (``free``: measured already, else measured now): the machine's
    state, not the candidate's, so it is named with its fix and never cached."""
    if res.ok or res.cause in ENVIRONMENTAL_CAUSES:
        return res
    from ..machine.files import free_bytes

    free = free_bytes(temp_root) if free is None else free
    if free is None or free >= LOW_SPACE_BYTES:
        return res
    return replace(res, cause="no_space", detail=f"the temp directory {temp_root} has "
                   f"{human_bytes(free)} free ({res.cause}: {res.detail})")


#: The causes that are no verdict on the candidate (`causes.NO_VERDICT_CAUSES`): its
#: workers could not write their files; its workers' exit status was taken by another reaper.
NO_SPACE, STATUS_LOST = "no_space", "status_lost"


def no_space_error(c: Candidate, res: ProbeResult, temp_root: str) -> NoSpaceError:
    """A probe that could not write its files (``no_space``): no verdict on ``c``'s transport,
    so the decision stops here, naming the temp directory, rather than fall back to fewer
    processes on a disk's account (nothing of it is cached)."""
    log.info("resilient_strategy: the probe of %s could not write its files: %s", c.key,
             res.detail)
    return NoSpaceError(f"{temp_root.rstrip('/') or '/'}/rs-probe-...",
                        f"the files of the probe of {c.label} (unknown: no space)")


def launch_fault_error(c: Candidate, res: ProbeResult) -> LaunchFaultError:
    """A probe that failed for the launch's reason (`LAUNCH_CAUSES`: a library that breaks
    ``import torch``, a port held, ...): no verdict on ``c``, and every other candidate would
    fail the same way, so the decision stops here naming it, rather than fall back to one
    device that dies the same way (nothing of it is cached)."""
    log.info("resilient_strategy: the probe of %s failed for the launch's reason: %s", c.key,
             res.detail)
    return LaunchFaultError(res.cause, c.label, CAUSES.get(res.cause, res.cause),
                            " ".join(res.detail.split())[:200])


def trusted_results(
    entries: Mapping[str, CachedResult], reprove: bool
) -> tuple[dict[str, ProbeResult], list[Event]]:
    """The cached results to plan with, and an event per cached failure saying whether it is
    trusted or probed again. A failure seen in one run only may have been an overloaded machine
    (a timeout under load): with ``reprove`` it is left out, so its candidate is probed again
    before anything slower is chosen because of it; seen in two runs in a row, it is trusted."""
    out: dict[str, ProbeResult] = {}
    events: list[Event] = []
    for key, e in sorted(entries.items()):
        if e.result.ok:
            out[key] = e.result
            continue
        trusted = e.seen >= 2 or not reprove
        if trusted:
            out[key] = e.result
        events.append(CachedFailure(key, e.result.status, e.seen, trusted))
    return out, events


def still_valid(results: Mapping[str, ProbeResult], timeout_s: float) -> dict[str, ProbeResult]:
    """Cached results that still hold for this run: a hang remembered from a shorter timeout
    than this run's (its elapsed time is the timeout it had) may just have been too impatient.
    A hang judged from the workers' progress (stuck in a collective) holds whatever the timeout."""
    return {
        k: r for k, r in results.items()
        if judged_hang(r) or not (r.status == TIMEOUT and r.elapsed_s < 0.95 * timeout_s)
    }


def failure_cause(r: RuledOut) -> FailureCause:
    """Why one candidate is out, for NoWorkingStrategyError."""
    if r.result is not None:
        return FailureCause(r.candidate.label, r.candidate.key, r.result.status, r.result.cause,
                            r.reason)
    return FailureCause(r.candidate.label, r.candidate.key, "ruled_out",
                        r.rule or "global_batch_size", r.reason)


class _DefaultProber(Prober):
    """The real prober, with the GPU health check deferred to the decision (see
    `probing.health.Unproven`); imports the probing layer's runner when first used."""

    starts_processes = True
    defers_gpu_check = True

    def probe(self, spec: ProbeSpec, env: Mapping[str, str]) -> ProbeResult:
        from ..probing.prober import run_probe

        return run_probe(spec, env, health_check=False)

    def check_gpus(self, framework: str, devices: tuple[int, ...],
                   env: Mapping[str, str]) -> list[tuple[int, str]]:
        from ..probing.prober import DeferredHealthProber

        return DeferredHealthProber().check_gpus(framework, devices, env)

    def check_seconds(self, framework: str, gpus: int, env: Mapping[str, str]) -> float:
        from ..probing.prober import DeferredHealthProber

        return DeferredHealthProber().check_seconds(framework, gpus, env)


default_prober: Prober = _DefaultProber()
