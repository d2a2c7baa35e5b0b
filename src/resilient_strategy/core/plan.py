"""The planner: facts + rules + probe results + policy -> ordered candidates and a trace.

Longer than ~450 lines on purpose: the planner's steps (chain, rules, batch split, memory,
results, ranking, choice) each take and return data in order, and reading them top to bottom is
reading one plan; each step's tables live in their own modules (rules, remedies, sharding,
estimate).

Pure: takes data, returns data. It never imports os, subprocess, pynvml or a framework (a test
checks this). The executor calls `plan` in a loop: probe ``plan.next_probe``, add its
result, plan again, until a candidate is chosen. Each round adds a result for a new candidate,
and the set of candidates is finite, so the loop ends.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..errors import InvalidOptionError
from ..vocab import MULTI_WORKER_BACKENDS
from .candidate import Candidate
from .causes import GPU_WIDE_CAUSES
from .estimate import Estimate, estimate
from .facts import Facts
from .human import human_bytes
from .probe import TIMEOUT, ProbeResult
from .remedies import SETUP_HANG
from .rules import FactValue, Rule, fact_values, fired
from .sharding import check_memory, fewer_devices, offloaded, shard_chain
from .trace import (
    BatchSplit,
    CandidateRuledOut,
    Chosen,
    Event,
    FactsSeen,
    NextProbe,
    Note,
    NothingLeft,
    RankEntry,
    Ranking,
    RemedyQueued,
    RuleFired,
    Split,
    UserSettingKept,
    render,
)

if TYPE_CHECKING:
    from .options import Options

__all__ = ["Candidate", "Estimate", "Plan", "Ranked", "RuledOut", "estimate", "plan", "split_batch"]

#: Cause -> remedies is data (``remedies.toml``, `remedies`, ``Options.remedies``); a hang
#: judged in communicator set-up is its own cause there (``setup_hang``), in words:
_SETUP_HANG_WORDS = "a hang in communicator set-up"
#: A remedy that fails with another cause gets that cause's first remedy on top, while the
#: variables it sets number at most this (bounded: each combination is one more probe).
MAX_COMPOSED_VARS = 3


@dataclass(frozen=True)
class Ranked:
    candidate: Candidate
    estimate: Estimate
    result: ProbeResult | None = None


@dataclass(frozen=True)
class RuledOut:
    candidate: Candidate
    reason: str
    rule: str = ""  # rule id, or "probe"
    result: ProbeResult | None = None  # the failed probe, when a probe ruled it out


@dataclass(frozen=True)
class Plan:
    framework: str
    ranked: tuple[Ranked, ...]  # viable candidates, in the order they are tried
    ruled_out: tuple[RuledOut, ...]
    events: tuple[Event, ...]  # the trace, typed (see trace.py)
    warnings: tuple[str, ...]
    rules_fired: tuple[str, ...]
    chosen: Candidate | None = None
    next_probe: Candidate | None = None
    #: The replicas of the widest way to train this job: a one-device fallback keeps its
    #: per-device batch and accumulates up to this many steps (handed to `plan`).
    reference_replicas: int = 1

    @property
    def candidates(self) -> tuple[Candidate, ...]:
        return tuple(r.candidate for r in self.ranked)

    @property
    def trace(self) -> tuple[str, ...]:
        """The events as lines of text."""
        return render(self.events)

    def explain(self) -> str:
        return "\n".join(self.trace)


@dataclass
class _Build:
    """Mutable scratch for one plan() call; never escapes it."""

    simulated: bool = False
    events: list[Event] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    ruled_out: list[RuledOut] = field(default_factory=list)
    reference: int = 1  # the widest candidate's replicas, as the batch split used it

    def note(self, topic: str, message: str) -> None:
        self.events.append(Note(topic, message))

    def rule_out(self, c: Candidate, by: str, reason: str, *, rule: str = "", source: str = "",
                 result: ProbeResult | None = None, said: bool = False) -> None:
        self.ruled_out.append(RuledOut(c, reason, rule or ("probe" if by == "probe" else ""),
                                       result))
        self.events.append(CandidateRuledOut(c, by, reason, rule, source, result,
                                             self.simulated, said))


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
    out = _split_batches([c], policy, _Build(simulated=policy.simulated), max(1, reference))
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
) -> Plan:
    """Order every way to train on this machine, in the order to try them, and say why.

    ``reference_replicas``: the replicas of the plan this one follows (a worker of
    ``resilient-strategy run`` plans in a launch of its own, one process when the decision is
    one device; the supervisor's ``Plan.reference_replicas`` is handed down so that the split,
    its trace line, the memory check and the estimates are those of the per-device batch the
    job was sized for, not of the whole global batch in one step)."""
    b = _Build(simulated=policy.simulated)
    fw = policy.framework
    info = facts.framework(fw)
    gpus = _usable_gpus(facts, policy, b)
    b.events.append(FactsSeen(len(gpus), tuple(sorted({g.name for g in facts.gpus})), fw,
                              info.version, info.cuda, info.nccl,
                              driver=facts.driver_version if gpus else None,
                              hip=info.hip or ("?" if info.build == "rocm" else None)))

    if policy.logical_cpus:
        gpus = tuple(range(policy.logical_cpus))
        b.note("logical_cpus",
               f"Test mode: {policy.logical_cpus} logical CPU devices stand in for GPUs.")
    hits = fired(rules, facts, fw, replicas=len(gpus))
    if gpus and not policy.logical_cpus and any(r.effect == "no_gpu" for r in hits):
        gpus = ()  # the build cannot run on these GPUs at all: planned as without them
    base, reference = _chain(fw, gpus, info.has_cuda or bool(policy.logical_cpus), policy, b,
                             info.build)
    reference = max(reference, reference_replicas)
    base = _shard(base, facts, policy, b)
    cands = _apply_rules(base, hits, policy, b)
    cands = _split_batches(cands, policy, b, reference)  # before results: keys name devices
    values = fact_values(facts, fw, replicas=len(gpus), nodes=policy.nodes) if results else {}
    chain = cands
    cands = _fitting(cands, facts, policy, b)
    cands = _apply_results(cands, results, policy, b, values)
    cands = _memory_rungs(chain, cands, facts, results, policy, b, values)

    ranked = _rank(cands, facts, results, policy, b)
    chosen, next_probe = _choose(ranked, b, policy)
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


def _usable_gpus(facts: Facts, policy: Options, b: _Build) -> tuple[int, ...]:
    visible = tuple(g.index for g in facts.gpus)
    if facts.nvml_error and not visible:
        b.note("no_gpu_facts", f"No GPU facts: {facts.nvml_error}.")
    for note in facts.visibility.notes:
        b.note("visible_devices", f"CUDA_VISIBLE_DEVICES: {note}")
    if facts.nvml_notes:
        b.note("nvml_unread", "NVML could not read some facts, which count as unknown (no rule "
               "fires on them): " + "; ".join(facts.nvml_notes) + ".")
    if policy.devices is None:
        return visible
    missing = [d for d in policy.devices if d not in visible]
    if missing:
        raise InvalidOptionError(
            f"devices={list(policy.devices)} names GPU(s) {missing} that this job cannot see "
            f"(visible: {list(visible)}; indices are after CUDA_VISIBLE_DEVICES)"
        )
    b.note("devices_asked", f"Using GPUs {list(policy.devices)} as asked (devices=).")
    return tuple(policy.devices)


def _chain(
    fw: str, gpus: tuple[int, ...], has_cuda: bool, policy: Options, b: _Build,
    build: str = "",
) -> tuple[list[Candidate], int]:
    """The static chain for this framework, before rules and results, and the number of
    devices the best plan would use (the one-device fallbacks accumulate that many steps)."""
    out: list[Candidate] = []
    n_proc = policy.world_size if fw == "torch" else 1
    nodes = policy.nodes if fw == "torch" else 1
    local = n_proc // nodes  # processes (and GPUs used) per node
    if gpus and not has_cuda:
        if build == "rocm":  # not CPU-only: it runs AMD GPUs, and these are NVIDIA's
            b.note("rocm_build", f"{fw} is a ROCm build (AMD GPUs through HIP): it cannot use "
                   "these NVIDIA GPUs; install a CUDA build to use them.")
        else:
            b.note("cpu_only_build",
                   f"{fw} is a CPU-only build: the GPUs are unusable from it; install a CUDA "
                   "build to use them.")
        gpus = ()
    if policy.multi_worker:
        return _multi_worker_chain(fw, gpus, has_cuda, policy, b)
    if fw == "tensorflow" and policy.tf_task.startswith("evaluator"):
        b.note("tf_evaluator", f"TF_CONFIG names this task {policy.tf_task}: an evaluator sits "
               "outside the workers' collectives (as in MultiWorkerMirroredStrategy), so it plans "
               "its own devices alone.")
    if fw == "torch" and n_proc > 1:
        multi_devs = gpus[:local] if len(gpus) >= local else ()
        if gpus and len(gpus) < local:
            b.note("too_few_gpus", f"The launcher started {local} processes on this node but "
                   f"only {len(gpus)} GPUs are visible.")
        if nodes > 1:
            b.note(
                "multi_node",
                f"Multi-node job: {nodes} nodes x {local} processes; a backend between nodes "
                "runs at the network's speed (no cache: a node's cache cannot speak for the "
                "links).",
            )
    else:
        multi_devs = gpus
    multi_ok = len(multi_devs) >= 2 or (fw == "torch" and n_proc > 1)
    reference = len(multi_devs) if multi_ok and multi_devs else max(1, n_proc)
    if fw == "torch" and n_proc == 1 and len(gpus) >= 2:
        advice = (
            f"This is one process, and PyTorch runs one process per GPU: it trains on one GPU "
            f"with {len(gpus)} accumulation steps here. To use all {len(gpus)} GPUs, start it "
            f"with `torchrun --nproc_per_node {len(gpus)} <your script>`."
        )
        b.note("one_process", advice)
        b.warnings.append(advice)
        multi_ok = False
    logical = bool(policy.logical_cpus)  # the "GPUs" are logical CPU devices (a test mode)
    if multi_ok and multi_devs:
        backends: tuple[str, ...] = ("nccl", "gloo") if fw == "torch" \
            else ("nccl", "hierarchical_copy", "reduction_to_one_device")
        if fw == "tensorflow" and logical:
            b.note("no_nccl_on_cpu", "NCCL is not tried on logical CPU devices: TensorFlow's "
                   "NcclAllReduce has no CPU kernel (it builds, then fails at the first step).")
            backends = backends[1:]
        replicas = len(multi_devs) * nodes
        for backend in backends:
            out.append(Candidate(fw, backend, multi_devs, num_replicas=replicas,
                                 logical_cpus=logical))
        if fw == "torch" and nodes > 1 and len(multi_devs) >= 2:
            # where the nodes cannot talk: node 0's own GPUs over NCCL (as TensorFlow keeps
            # worker 0's MirroredStrategy), not one GPU of the whole job
            out.append(Candidate(fw, "nccl", multi_devs, num_replicas=len(multi_devs),
                                 node_local=True))
    elif multi_ok:  # torch under a launcher on CPU: gloo between the processes
        out.append(Candidate(fw, "gloo", (), num_replicas=n_proc))
    if gpus:
        out.append(Candidate(fw, "single_device", gpus[:1], logical_cpus=logical))
    out.append(Candidate(fw, "cpu", ()))
    return out, reference


def _multi_worker_chain(
    fw: str, gpus: tuple[int, ...], has_cuda: bool, policy: Options, b: _Build
) -> tuple[list[Candidate], int]:
    """TensorFlow across the workers of a TF_CONFIG cluster: MultiWorkerMirroredStrategy with
    NCCL (GPU workers of a CUDA build), then with RING (TensorFlow's ring all-reduce over gRPC,
    CPU or GPU), then with AUTO (TensorFlow's pick, after RING: `_multi_worker_order`),
    each with every worker's local devices as replicas. Then worker 0 alone (the other workers
    exit): with 2+ local GPUs, MirroredStrategy over all of them (the local chain: NCCL,
    HierarchicalCopy, ReductionToOneDevice; the global batch kept by a larger per-replica batch,
    as Keras cannot accumulate under it), then on one device accumulating as many steps as the
    job has replicas. `_multi_worker_order` places worker 0's MirroredStrategy between.
    """
    workers = policy.tf_workers
    local = gpus if has_cuda else ()
    replicas = workers * max(1, len(local))
    b.note("multi_worker", (
        f"Multi-worker job (TF_CONFIG): this task is {policy.tf_task or 'a worker'}, worker "
        f"{policy.tf_worker_rank} of {workers}; MultiWorkerMirroredStrategy runs at the "
        "network's speed between workers, and every worker proves it together with the others "
        "(no cache: a worker's cache cannot speak for the links). When no backend across the "
        "workers beats worker 0 alone, worker 0 trains alone and the others exit 0: "
        + (f"on its {len(local)} GPUs under MirroredStrategy if that passes its probe, else "
           if len(local) >= 2 else "")
        + f"on one device with {replicas} accumulation steps."))
    out: list[Candidate] = []
    if local:
        out.append(Candidate(fw, "mw_nccl", local, num_replicas=replicas))
    out.append(Candidate(fw, "mw_ring", local, num_replicas=replicas))
    out.append(Candidate(fw, "mw_auto", local, num_replicas=replicas))
    if len(local) >= 2:  # worker 0 alone on all of its GPUs
        out += [Candidate(fw, backend, local, num_replicas=len(local))
                for backend in ("nccl", "hierarchical_copy", "reduction_to_one_device")]
    if gpus:
        out.append(Candidate(fw, "single_device", gpus[:1]))
    out.append(Candidate(fw, "cpu", ()))
    return out, replicas


def _shard(cands: list[Candidate], facts: Facts, policy: Options, b: _Build) -> list[Candidate]:
    """Shard the multi-process candidates (FSDP2) where ``sharding=`` says (sharding.py)."""
    out, event = shard_chain(cands, facts, policy)
    if event is not None:
        b.events.append(event)
    return out


def _fitting(cands: list[Candidate], facts: Facts, policy: Options, b: _Build) -> list[Candidate]:
    """Rule out the candidates whose model state does not fit their devices (sharding.py)."""
    too_big, event = check_memory(cands, facts, policy)
    if event is None:
        return cands
    b.events.append(event)
    for row in too_big:
        b.rule_out(row.candidate, "memory", row.text(), rule="memory", said=True)
    out = {row.candidate.key for row in too_big}
    return [c for c in cands if c.key not in out]


def _memory_rungs(chain: list[Candidate], cands: list[Candidate], facts: Facts,
                  results: Mapping[str, ProbeResult], policy: Options, b: _Build,
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
          event: Event | None, results: Mapping[str, ProbeResult], policy: Options, b: _Build,
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


def _user_set(policy: Options, env: Mapping[str, str]) -> list[str]:
    return sorted(k for k in env if k in policy.user_env)


def _with_env(c: Candidate, env: Mapping[str, str], origin: str, first: bool = False) -> Candidate:
    merged = dict(c.env)
    merged.update(env)
    return replace(c, env=tuple(sorted(merged.items())), origin=origin, first=first)


def _apply_rules(
    cands: list[Candidate], hits: Sequence[Rule], policy: Options, b: _Build
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
    cands: list[Candidate], results: Mapping[str, ProbeResult], policy: Options, b: _Build,
    values: Mapping[str, FactValue],
) -> list[Candidate]:
    out: list[Candidate] = []
    queue = list(cands)
    i = 0
    while i < len(queue):
        c = queue[i]
        i += 1
        res = results.get(c.key)
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
        if c.backend not in ("nccl", "gloo"):
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


def _split_batches(
    cands: list[Candidate], policy: Options, b: _Build, reference: int
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


# --------------------------------------------------------------------------------------------
# Ranking (the cost model is estimate.py)
# --------------------------------------------------------------------------------------------
def _rank(
    cands: list[Candidate],
    facts: Facts,
    results: Mapping[str, ProbeResult],
    policy: Options,
    b: _Build,
) -> list[Ranked]:
    ranked = [Ranked(c, estimate(c, facts, results.get(c.key), policy), results.get(c.key)) for c in cands]
    order = {c.key: i for i, c in enumerate(cands)}

    # sharding="full" is the user's choice: a candidate that does not shard (one device)
    # stays a fallback, below every sharded one, whatever its estimate
    asked_to_shard = policy.sharding == "full" and any(c.sharded for c in cands)

    def key(r: Ranked) -> tuple[int, float, int]:
        c = r.candidate
        group = 3 if c.backend == "cpu" else (0 if policy.prefer == c.backend else 1)
        if group == 1 and asked_to_shard and not c.sharded:
            group = 2
        return (group, r.estimate.step_seconds, order[c.key])

    ranked.sort(key=key)
    ranked = _within_noise_keep_order(ranked, order, {r.candidate.key: key(r)[0] for r in ranked}, b)
    # A remedy marked `first` goes right before plain NCCL, whatever its estimate.
    firsts = [r for r in ranked if r.candidate.first]
    plain = next((i for i, r in enumerate(ranked)
                  if r.candidate.backend == "nccl" and not r.candidate.first), None)
    tried_first: list[str] = []  # rules whose remedy goes above a candidate estimated faster
    if firsts and plain is not None:  # without plain NCCL left, the estimate alone orders them
        rest = [r for r in ranked if not r.candidate.first]
        at = rest.index(ranked[plain])
        ranked = [*rest[:at], *firsts, *rest[at:]]
        for f in firsts:
            below = ranked[ranked.index(f) + 1:]
            if any(r.estimate.step_seconds < f.estimate.step_seconds for r in below
                   if r.candidate.backend != "cpu") and f.candidate.origin not in tried_first:
                tried_first.append(f.candidate.origin)
    if policy.multi_worker:
        ranked = _multi_worker_order(ranked, b)
    elif any(r.candidate.node_local for r in ranked):
        ranked = _node_local_order(ranked, b)
    if policy.prefer and not any(r.candidate.backend == policy.prefer for r in ranked):
        b.note("prefer_impossible",
               f"prefer={policy.prefer!r} is not possible here; choosing by speed instead.")
    basis = (
        f"gradients {human_bytes(policy.gradient_bytes)}" if policy.gradient_bytes
        else "pass gradient_bytes= or model= to rank the candidates by their speed"
    )
    cpu = [r.estimate.step_seconds for r in ranked if r.candidate.backend == "cpu"]
    cpu_last = bool(cpu) and any(r.estimate.step_seconds > cpu[0] for r in ranked
                                 if r.candidate.backend != "cpu")
    b.events.append(Ranking(
        tuple(RankEntry(r.candidate, r.estimate.step_seconds, r.estimate.basis) for r in ranked),
        basis, cpu_last, tuple(tried_first), known_size=policy.gradient_bytes is not None,
    ))
    return ranked


def _node_local_order(ranked: list[Ranked], b: _Build) -> list[Ranked]:
    """A multi-node torch job's node-0-alone candidate goes right before the first candidate
    without a collective (one GPU or CPU: where rank 0 trains alone anyway), after every
    candidate across the nodes ranked above that one, as `_multi_worker_order` does for
    TensorFlow's worker 0: once the plan reaches node 0 alone, the other nodes idle."""
    anchor = next((i for i, r in enumerate(ranked) if not r.candidate.needs_probe), None)
    if anchor is None:
        return ranked
    local = [r for r in ranked[:anchor] if r.candidate.node_local]
    across = [r for r in ranked[:anchor] if not r.candidate.node_local]
    out = [*across, *local, *ranked[anchor:]]
    if local and across and out != ranked:
        b.note("alone_after_nodes", f"Node 0's own {local[0].candidate.label} is tried only "
               "after the strategies across the nodes estimated faster than one GPU: once node "
               "0 trains alone, the other nodes' ranks idle.")
    return out


def _multi_worker_order(ranked: list[Ranked], b: _Build) -> list[Ranked]:
    """A TF_CONFIG job's two orders the estimate alone does not give.

    AUTO never ranks above RING: TensorFlow resolves it to the same ring all-reduce (see
    ``estimate.TYPICAL_INTER_WORKER_GBPS``), so it is the rung after a failed RING, never a probe
    spent because RING's measured figure fell below AUTO's typical one.

    Worker 0's own MirroredStrategy (a local candidate that needs a probe, which only worker 0
    runs) goes right before the first candidate without a collective (one device, or CPU: where
    worker 0 trains alone anyway), after every candidate across the workers ranked above that
    one. So the workers agree without a store: once a plan reaches worker 0 alone, no candidate
    across the workers follows (the others exit then), and the estimate still decides whether
    the workers are tried at all and whether the local MirroredStrategy beats one device (ranked
    below it, it is never reached)."""
    where = {r.candidate.backend: i for i, r in enumerate(ranked)}
    ring, auto = where.get("mw_ring"), where.get("mw_auto")
    if ring is not None and auto is not None and auto < ring:
        ranked = [*ranked[:auto], *ranked[auto + 1:ring + 1], ranked[auto], *ranked[ring + 1:]]
    anchor = next((i for i, r in enumerate(ranked) if not r.candidate.needs_probe), None)
    if anchor is None:
        return ranked
    local = [r for r in ranked[:anchor] if r.candidate.backend not in MULTI_WORKER_BACKENDS]
    workers = [r for r in ranked[:anchor] if r.candidate.backend in MULTI_WORKER_BACKENDS]
    out = [*workers, *local, *ranked[anchor:]]
    if local and workers and out != ranked:
        b.note("alone_after_workers", f"Worker 0's own {local[0].candidate.label} is tried only "
               "after the strategies across the workers estimated faster than one device: once "
               "worker 0 trains alone, the other workers have exited.")
    return out


def _measured(r: Ranked) -> tuple[float, float] | None:
    """(bus GB/s, relative spread) of a candidate whose probe measured both."""
    res = r.result
    if res is None or not res.ok or not res.bus_bandwidth_gbps or res.bandwidth_spread is None:
        return None
    return res.bus_bandwidth_gbps, res.bandwidth_spread


def _within_noise_keep_order(
    ranked: list[Ranked], order: Mapping[str, int], groups: Mapping[str, int], b: _Build
) -> list[Ranked]:
    """Measured speeds rank two candidates only where they differ by more than the noise
    measured with them; otherwise the chain's order stands (so a loaded machine does not flip
    the choice between runs). Adjacent pairs, repeated until stable (bounded: n passes)."""
    out = list(ranked)
    kept: list[str] = []
    for _ in range(len(out)):
        swapped = False
        for i in range(len(out) - 1):
            a, z = out[i], out[i + 1]
            ma, mz = _measured(a), _measured(z)
            if ma is None or mz is None or order[a.candidate.key] < order[z.candidate.key]:
                continue
            if groups[a.candidate.key] != groups[z.candidate.key]:  # prefer= and CPU-last stand
                continue
            difference = abs(ma[0] - mz[0]) / min(ma[0], mz[0])
            noise = max(ma[1], mz[1])
            if difference <= noise:
                out[i], out[i + 1] = z, a
                swapped = True
                kept.append(f"{z.candidate.label} ({mz[0]:g} GB/s) before {a.candidate.label} "
                            f"({ma[0]:g} GB/s): they differ by {difference:.0%}, within the "
                            f"measured noise of {noise:.0%}")
        if not swapped:
            break
    if kept:
        b.note("within_noise", "Kept the chain's order where speeds are within noise: "
               + "; ".join(kept) + ".")
    return out


def _choose(ranked: Sequence[Ranked], b: _Build, policy: Options
            ) -> tuple[Candidate | None, Candidate | None]:
    for r in ranked:
        c = r.candidate
        if r.result is not None and r.result.ok:
            b.events.append(Chosen(c, "probe_passed", r.result, b.simulated))
            return c, None
        if not c.needs_probe:
            b.events.append(Chosen(c, "no_collective"))
            return c, None
        if (policy.multi_worker and policy.tf_worker_rank
                and c.backend not in MULTI_WORKER_BACKENDS):
            # worker 0 proves its own MirroredStrategy; what it finds changes nothing here
            b.events.append(Chosen(c, "worker_0_alone"))
            return c, None
        b.events.append(NextProbe(c))
        return None, c
    b.events.append(NothingLeft())
    return None, None
