"""The planner: facts + rules + probe results + policy -> ordered candidates and a trace.

`plan` runs the steps in order, each taking and returning data: the chain (`chain`), the
known-issue rules, the batch split, what probes proved and the memory steps (here), the ranking
and the choice (`ranking`); the shapes it returns are `shapes`'. Each step's tables live in their
own modules (rules, remedies, sharding, estimate).

Pure: takes data, returns data. It never imports os, subprocess, pynvml or a framework (a test
checks this). The executor calls `plan` in a loop: probe ``plan.next_probe``, add its
result, plan again, until a candidate is chosen. Each round adds a result for a new candidate,
and the set of candidates is finite, so the loop ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from ...vocab import MULTI_WORKER_BACKENDS, PROCESS_GROUP_BACKENDS
from ..knowledge import nccldiag
from ..knowledge.causes import GPU_WIDE_CAUSES
from ..knowledge.clauses import FactValue, fact_values
from ..knowledge.nodefacts import compare
from ..knowledge.remedies import SETUP_HANG
from ..knowledge.rules import Rule, fired
from ..measures.estimate import Estimate, MeasuredStep, estimate
from ..measures.probe import BUSY_RETRIED, HOST_BUSY, TIMEOUT, ProbeResult
from ..trace.choosing import BatchSplit, HostBusy, Split
from ..trace.event import Event
from ..trace.inputs import FactsSeen
from ..trace.ruling import NcclDiagnostics, NodesDiffer, RemedyQueued, RuleFired, UserSettingKept
from ..values.candidate import Candidate
from ..values.facts import Facts
from .chain import build_chain, fitting, shard, usable_gpus
from .ranking import choose, rank_candidates
from .shapes import Build, Plan, Ranked, RuledOut
from .sharding import fewer_devices, offloaded

if TYPE_CHECKING:
    from ..call.options import Options

__all__ = ["Candidate", "Estimate", "MeasuredStep", "Plan", "Ranked", "RuledOut", "estimate", "plan", "split_batch"]

#: Cause -> remedies is data (``remedies.toml``, `remedies`, ``Options.remedies``); a hang
#: judged in communicator set-up is its own cause there (``setup_hang``), in words:
_SETUP_HANG_WORDS = "a hang in communicator set-up"
#: A remedy that fails with another cause gets that cause's first remedy on top, while the
#: variables it sets number at most this (bounded: each combination is one more probe).
MAX_COMPOSED_VARS = 3


# --------------------------------------------------------------------------------------------
# Batch arithmetic
# --------------------------------------------------------------------------------------------
def split_batch(global_batch: int, replicas: int, micro_cap: int) -> tuple[int, int]:
    """(per_replica_batch, accumulation_steps) with replicas * per * acc == global_batch exactly
    and per <= micro_cap where possible (smallest accumulation that fits)."""
    if global_batch % replicas:
        raise ValueError(f"{global_batch} is not divisible by {replicas}")
    share = global_batch // replicas
    small = [d for d in range(1, int(share**0.5) + 1) if share % d == 0]
    for acc in sorted({*small, *(share // d for d in small)}):  # every divisor, ascending
        if share // acc <= micro_cap:
            return share // acc, acc
    return 1, share


def _resplit(c: Candidate, policy: Options, reference: int) -> Candidate:
    """``c`` with the batch split it gets in a plan whose widest candidate has ``reference``
    replicas (a rung added after the split: FSDP over fewer GPUs)."""
    out = _split_batches([c], policy, Build(simulated=policy.simulated), max(1, reference))
    return out[0] if out else c


def _largest_divisor_at_most(n: int, limit: int) -> int:
    return max(d for d in range(1, max(1, limit) + 1) if n % d == 0)


# --------------------------------------------------------------------------------------------
# The plan
# --------------------------------------------------------------------------------------------
def plan(
    facts: Facts,
    rules: Sequence[Rule],
    results: Mapping[str, ProbeResult],
    policy: Options,
    *,
    reference_replicas: int = 1,
    measured: MeasuredStep | None = None,
) -> Plan:
    """Order every way to train on this machine, in the order to try them, and say why.

    ``reference_replicas``: the replicas of the plan this one follows (a worker of
    ``resilient-strategy run`` plans in a launch of its own, one process when the decision is
    one device; the supervisor's ``Plan.reference_replicas`` is handed down so that the split,
    its trace line, the memory check and the estimates are those of the per-device batch the
    job was sized for, not of the whole global batch in one step).

    ``measured``: the user's own step, measured (the compute of one sample); with it, or with
    ``sample_seconds=``, an estimate may rank fewer GPUs first; without, an NCCL-family
    candidate on every GPU ranks above fewer GPUs (`ranking`)."""
    b = Build(simulated=policy.simulated)
    fw = policy.framework
    info = facts.framework(fw)
    gpus = usable_gpus(facts, policy, b)
    b.events.append(FactsSeen(len(gpus), tuple(sorted({g.name for g in facts.gpus})), fw,
                              info.version, info.cuda, info.nccl,
                              driver=facts.driver_version if gpus else None,
                              hip=info.hip or ("?" if info.build == "rocm" else None)))

    if policy.logical_cpus:
        gpus = tuple(range(policy.logical_cpus))
        b.note("logical_cpus",
               f"Test mode: {policy.logical_cpus} logical CPU devices stand in for GPUs.")
    hits = fired(rules, facts, fw, replicas=len(gpus), nodes=policy.nodes)
    if gpus and not policy.logical_cpus and any(r.effect == "no_gpu" for r in hits):
        gpus = ()  # the build cannot run on these GPUs at all: planned as without them
    base, reference = build_chain(fw, gpus, info.has_cuda or bool(policy.logical_cpus), policy, b,
                                  info.build, mig=any(g.mig_enabled for g in facts.gpus
                                                      if g.index in gpus))
    reference = max(reference, reference_replicas)
    base = shard(base, facts, policy, b)
    cands = _apply_rules(base, hits, policy, b)
    cands = _compare_nodes(cands, facts, policy, b)
    cands = _split_batches(cands, policy, b, reference)  # before results: keys name devices
    values = fact_values(facts, fw, replicas=len(gpus), nodes=policy.nodes) if results else {}
    chain = cands
    cands = fitting(cands, facts, policy, b)
    cands = _apply_results(cands, results, policy, b, values)
    cands = _memory_rungs(chain, cands, facts, results, policy, b, values)

    ranked = rank_candidates(cands, facts, results, policy, b, measured)
    chosen, next_probe = choose(ranked, b, policy)
    return Plan(
        framework=fw,
        ranked=tuple(ranked),
        ruled_out=tuple(b.ruled_out),
        events=tuple(b.events),
        warnings=tuple(b.warnings),
        rules_fired=tuple(r.id for r in hits),
        chosen=chosen,
        next_probe=next_probe,
        reference_replicas=b.reference,
    )


def _user_set(policy: Options, env: Mapping[str, str]) -> list[str]:
    return sorted(k for k in env if k in policy.user_env)


def _with_env(c: Candidate, env: Mapping[str, str], origin: str, first: bool = False) -> Candidate:
    merged = dict(c.env)
    merged.update(env)
    return replace(c, env=tuple(sorted(merged.items())), origin=origin, first=first)


def _apply_rules(
    cands: list[Candidate], hits: Sequence[Rule], policy: Options, b: Build
) -> list[Candidate]:
    for rule in hits:
        cite = f"[{rule.id}] {rule.message} (source: {rule.source})"

        def fired_(action: str, rule: Rule = rule, **kw: Any) -> None:
            b.events.append(RuleFired(rule.id, rule.effect, action, rule.message, rule.source, **kw))

        if rule.effect == "warn":
            b.warnings.append(cite)
            fired_("warn")
        elif rule.effect == "no_gpu":  # the chain was planned without the GPUs (`plan`)
            b.warnings.append(cite)
            fired_("no_gpu")
        elif rule.effect == "veto":
            out = [c for c in cands if _vetoed(c, rule.target)]
            if out:  # one line names every candidate it rules out, the rule's text once
                fired_("veto", candidates=tuple(out), targets=tuple(rule.target))
            else:
                # An earlier rule already removed its targets: its advice (what to install)
                # still reaches the trace, as that is what the user can act on.
                gone = tuple(sorted({r.candidate.backend for r in b.ruled_out
                                     if r.candidate.backend in rule.target}))
                if gone:
                    fired_("already_ruled_out", targets=gone)
            for c in out:
                b.rule_out(c, "rule", rule.message, rule=rule.id, source=rule.source, said=True)
            cands = [c for c in cands if not _vetoed(c, rule.target)]
        elif rule.effect == "prefer":
            cands = [c for c in cands if c.backend in rule.target] + [
                c for c in cands if c.backend not in rule.target
            ]
            fired_("prefer", targets=tuple(rule.target))
        elif rule.effect in ("remedy", "set_env"):
            env = dict(rule.env)
            taken = _user_set(policy, env)
            if taken:
                b.events.append(UserSettingKept(rule.id, tuple(taken)))
                env = {k: v for k, v in env.items() if k not in taken}
                if not env:
                    continue
            pairs = tuple(sorted(env.items()))
            nccl = [c for c in cands if c.backend == "nccl" and c.origin == "chain"]
            if not nccl:
                fired_("nothing_to_act_on", env=pairs)
                continue
            if rule.effect == "set_env":
                cands = [_with_env(c, env, c.origin) if c in nccl else c for c in cands]
                fired_("set_env", env=pairs, candidates=tuple(nccl))
                continue
            remedy = _with_env(nccl[0], env, rule.id, rule.first)
            if any(c.key == remedy.key for c in cands):
                fired_("remedy_exists", env=pairs, candidates=(remedy,))
                continue
            cands = _insert_remedy(cands, remedy)
            fired_("remedy_added", env=pairs, candidates=(remedy,), first=rule.first)
    return cands


def _compare_nodes(cands: list[Candidate], facts: Facts, policy: Options,
                   b: Build) -> list[Candidate]:
    """A multi-node torch job whose nodes sent their facts (``facts.nodes``): each difference
    that matters (`nodefacts.compare`, from data) in the trace and the warnings, before any
    probe; one whose effect is ``rule_out`` rules NCCL between the nodes out (node 0's own NCCL
    and gloo between the nodes stay), except a candidate that sets its ``keep_env``."""
    if policy.framework != "torch" or policy.nodes <= 1 or len(facts.nodes) < 2:
        return cands
    user = facts.env_map
    for finding in compare(facts.nodes):
        out: list[Candidate] = []
        if finding.effect == "rule_out":
            out = [c for c in cands if c.backend == "nccl" and not c.node_local
                   and not finding.keeps({**user, **dict(c.env)})]
        event = NodesDiffer(finding, tuple(out))
        b.events.append(event)
        b.warnings.append(event.text())
        for c in out:
            b.rule_out(c, "rule", finding.message, rule=finding.id, source=finding.source,
                       said=True)
        cands = [c for c in cands if c not in out]
    return cands


def _vetoed(c: Candidate, target: Sequence[str]) -> bool:
    """Whether a veto of ``target`` rules ``c`` out. Across TF workers the same NCCL runs
    (a veto of ``nccl`` covers ``mw_nccl``), and GPUs that cannot run one device (a veto of
    ``single_device``) cannot run a strategy across workers on them either."""
    if c.backend in target:
        return True
    if c.backend == "mw_nccl" and "nccl" in target:
        return True
    return c.backend in MULTI_WORKER_BACKENDS and bool(c.devices) and "single_device" in target


def _insert_remedy(cands: list[Candidate], remedy: Candidate) -> list[Candidate]:
    # after the last NCCL of the chain proper (node 0's own NCCL, a multi-node job's fallback,
    # comes after the strategies across the nodes)
    last_nccl = max(i for i, c in enumerate(cands) if c.backend == "nccl" and not c.node_local)
    return [*cands[: last_nccl + 1], remedy, *cands[last_nccl + 1 :]]


def _apply_results(
    cands: list[Candidate], results: Mapping[str, ProbeResult], policy: Options, b: Build,
    values: Mapping[str, FactValue],
) -> list[Candidate]:
    out: list[Candidate] = []
    queue = list(cands)
    i = 0
    while i < len(queue):
        c = queue[i]
        i += 1
        res = results.get(c.key)
        if res is not None:
            _nccl_said(c, res, b)
            _host_busy(c, res, b)
        if res is None or res.ok:
            out.append(c)
            continue
        b.rule_out(c, "probe", res.why(), result=res)
        if res.cause in GPU_WIDE_CAUSES:  # no GPU of this process runs: every GPU candidate out
            for other in [x for x in out + queue[i:] if x.devices and not x.logical_cpus]:
                b.rule_out(other, "probe", f"{c.label} failed: {res.why()}", result=res)
            out = [x for x in out if not x.devices or x.logical_cpus]
            queue = queue[:i] + [x for x in queue[i:] if not x.devices or x.logical_cpus]
            continue
        if c.backend not in PROCESS_GROUP_BACKENDS:
            continue
        # Plain NCCL's (or gloo's) failure suggests its cause's remedies (remedies.toml, each
        # gated by the facts). A remedy that fails with a *different* cause gets that cause's
        # first remedy added on top (P2P off, then failing on shared memory: P2P and SHM off),
        # bounded by MAX_COMPOSED_VARS; a remedy failing with the same cause, or hanging, is not
        # remedied again (each try costs a probe, and a hang says too little to pick one).
        cause = label = res.cause
        if (cause == "timeout" and dict(res.extra).get("hang") == "setup"
                and policy.remedies.for_cause(SETUP_HANG, c.backend, values)):
            cause, label = SETUP_HANG, _SETUP_HANG_WORDS
        options = list(policy.remedies.for_cause(cause, c.backend, values))
        if c.origin != "chain":
            if (res.status == TIMEOUT or c.origin == f"after {label}"
                    or len(c.env) >= MAX_COMPOSED_VARS):
                continue
            options = options[:1]
        at = i
        for remedy_entry, env in options:
            if set(env.items()) <= set(c.env):
                continue
            taken = _user_set(policy, env)
            if taken:  # the user's value stands, and the trace names it
                b.events.append(UserSettingKept(f"{remedy_entry.id} (remedy for {label})",
                                                tuple(taken)))
                continue
            remedy = _with_env(c, env, f"after {label}")
            if any(x.key == remedy.key for x in queue) or any(
                    r.candidate.key == remedy.key for r in b.ruled_out):
                continue
            queue.insert(at, remedy)  # tried right after what failed; examined in this loop
            at += 1
            b.events.append(RemedyQueued(remedy, label,
                                         on_top_of=None if c.origin == "chain" else c,
                                         remedy=remedy_entry.id,
                                         because=tuple(str(w) for w in remedy_entry.when)))
    return out


def _host_busy(c: Candidate, res: ProbeResult, b: Build) -> None:
    """A probe cut while the host was too busy to run it, and its retry, as an event."""
    extra = dict(res.extra)
    if HOST_BUSY not in extra and BUSY_RETRIED not in extra:
        return

    def number(key: str) -> float | None:
        try:
            return float(extra[key])
        except (KeyError, ValueError):
            return None

    b.events.append(HostBusy(c, number(HOST_BUSY), number(BUSY_RETRIED), res.ok))


def _nccl_said(c: Candidate, res: ProbeResult, b: Build) -> None:
    """What NCCL's own diagnostics said in ``c``'s probe, and how NCCL ran there, as an event
    (informational: the verdict stays the probe's)."""
    report, set_, kept = nccldiag.from_extra(res.extra)
    if report.findings or set_ or kept:
        b.events.append(NcclDiagnostics(c, res.ok, set_, kept, report.findings,
                                        report.completed))


def _split_batches(
    cands: list[Candidate], policy: Options, b: Build, reference: int
) -> list[Candidate]:
    g = policy.global_batch_size
    top = max([reference, *(c.num_replicas for c in cands)])
    b.reference = top
    if g is None:
        out = []
        for c in cands:
            acc = 1 if c.num_replicas > 1 else top
            out.append(replace(c, accumulation_steps=acc))
        if top > 1:
            b.note(
                "no_global_batch",
                f"No global_batch_size given: multi-GPU strategies use your per-device batch; the "
                f"one-device fallbacks accumulate {top} steps so each optimizer step sees as many "
                "samples.",
            )
        return out
    top_r = _largest_divisor_at_most(g, top)
    cap = policy.max_per_replica_batch or g // top_r
    out = []
    said: set[str] = set()

    def once(topic: str, text: str) -> None:
        if text not in said:
            said.add(text)
            b.note(topic, text)

    for c in cands:
        r = c.num_replicas
        if r > 1 and g % r and c.backend in MULTI_WORKER_BACKENDS:  # workers cannot be dropped
            b.rule_out(c, "batch", f"global_batch_size={g} does not split over the {r} replicas "
                       "of the workers", said=True)
            once("batch_not_split", f"global_batch_size={g} does not split over the {r} "
                 f"replicas of the {policy.tf_workers} workers, so no strategy across them can "
                 f"keep it exact; use a multiple of {r} to train on every worker.")
            continue
        if r > 1 and g % r:
            r_fit = _largest_divisor_at_most(g, r)
            if r_fit < 2:
                b.rule_out(c, "batch", f"global_batch_size={g} does not split over GPUs",
                           said=True)
                once("batch_not_split", f"global_batch_size={g} does not split over {r} or fewer (>1) replicas, so "
                     f"no multi-GPU strategy can keep it exact; use a multiple of {r} to use "
                     f"{r} GPUs.")
                continue
            once("batch_shrinks_replicas",
                 f"global_batch_size={g} does not split over {r} replicas; the multi-GPU "
                 f"strategies use {r_fit} GPU(s) so the global batch stays exact.")
            c = replace(c, devices=c.devices[:r_fit] if c.devices else (), num_replicas=r_fit)
            r = r_fit
        if c.framework == "tensorflow" and r > 1:
            # Keras cannot accumulate under MirroredStrategy (keras-team/keras#20582)
            per, acc = g // r, 1
            if policy.max_per_replica_batch and per > policy.max_per_replica_batch:
                why = (f"its per-replica batch would be {per} > max_per_replica_batch="
                       f"{policy.max_per_replica_batch}, and Keras cannot accumulate gradients "
                       "under MirroredStrategy (keras-team/keras#20582)")
                b.rule_out(c, "batch", why)
                continue
        else:
            per, acc = split_batch(g, r, cap)
        out.append(replace(c, per_replica_batch_size=per, accumulation_steps=acc, global_batch_size=g))
    b.events.append(BatchSplit(g, tuple(
        Split(c.backend, c.num_replicas, c.per_replica_batch_size, c.accumulation_steps)
        for c in _dedupe_backends(out)
    )))
    return out


def _dedupe_backends(cands: Sequence[Candidate]) -> list[Candidate]:
    seen: set[str] = set()
    out = []
    for c in cands:
        if c.backend not in seen:
            seen.add(c.backend)
            out.append(c)
    return out


def _memory_rungs(chain: list[Candidate], cands: list[Candidate], facts: Facts,
                  results: Mapping[str, ProbeResult], policy: Options, b: Build,
                  values: Mapping[str, FactValue]) -> list[Candidate]:
    """Step down to what fits (sharding.py): FSDP over fewer GPUs once FSDP over all of them is
    out, then the state offloaded to the host (``offload="auto"``) once no GPU candidate is."""
    fewer, too_big, event = fewer_devices(chain, cands, facts, policy)
    fewer = [_resplit(c, policy, b.reference) if policy.global_batch_size else c for c in fewer]
    cands = _rung(cands, fewer, too_big, event, results, policy, b, values)
    out = [r.candidate for r in b.ruled_out if r.rule == "memory"]
    off, too_big, offload = offloaded(out, cands, facts, policy)
    return _rung(cands, off, too_big, offload, results, policy, b, values)


def _rung(cands: list[Candidate], new: list[Candidate], too_big: Sequence[Any],
          event: Event | None, results: Mapping[str, ProbeResult], policy: Options, b: Build,
          values: Mapping[str, FactValue]) -> list[Candidate]:
    """``new`` candidates (with their probe results) after the multi-device ones of ``cands``,
    and the rows of those that do not fit ruled out (the event says them with the numbers)."""
    if event is not None:
        b.events.append(event)
    for row in too_big:
        b.rule_out(row.candidate, "memory", row.text(), rule="memory", said=True)
    if not new:
        return cands
    at = next((i for i, c in enumerate(cands) if c.num_replicas <= 1), len(cands))
    return [*cands[:at], *_apply_results(new, results, policy, b, values), *cands[at:]]


