"""Ranking the candidates left by estimated time (the cost model is `measures.estimate`), the
order that keeps node-local and TensorFlow worker-0 candidates in their place, measured results
within noise kept in order, and the choice: a candidate, or the next one to probe.

Proven GPUs are kept (issue 41): while nothing measured the user's compute (no ``measured``
step, no ``sample_seconds=``), an NCCL-family candidate (`NCCL_FAMILY`) on every GPU left ranks
above every candidate on fewer GPUs, whatever the estimates say: the estimate orders the
candidates on those same GPUs (which remedy first, NCCL or a reduction), and it orders the
degraded options (gloo across the GPUs against one GPU with accumulation) only when no
NCCL-family candidate on every GPU is left, saying that ranking is provisional
(`ProvisionalRanking`). Fewer GPUs rank first only from a measured compute, and the trace says
which (`FewerGpusRanked`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from ...vocab import MIRRORED_BACKENDS, MULTI_WORKER_BACKENDS, Backend
from ..measures.estimate import MeasuredStep, compute_source, estimate
from ..measures.probe import ProbeResult
from ..trace.choosing import (
    Chosen,
    FewerGpusRanked,
    NextProbe,
    NothingLeft,
    ProvisionalRanking,
    RankEntry,
    Ranking,
)
from ..values.candidate import Candidate
from ..values.facts import Facts
from ..values.human import human_bytes
from .shapes import Build, Ranked

if TYPE_CHECKING:
    from ..call.options import Options


#: The NCCL family, by framework: the backends whose candidate on every GPU keeps every GPU
#: while nothing measured the user's compute (NCCL, with or without remedies; TensorFlow's
#: MirroredStrategy with NCCL or its reductions, and NCCL across TF_CONFIG workers).
NCCL_FAMILY: dict[str, tuple[Backend, ...]] = {
    "torch": ("nccl",),
    "tensorflow": (*MIRRORED_BACKENDS, "mw_nccl"),
}


def nccl_family(c: Candidate) -> bool:
    """Whether ``c`` is of the NCCL family (`NCCL_FAMILY`) and runs a collective on GPUs (the
    logical CPU devices of TensorFlow's test mode are no GPUs to keep)."""
    return (c.num_replicas > 1 and not c.logical_cpus
            and c.backend in NCCL_FAMILY.get(c.framework, ()))


def every_gpu_kept(cands: Sequence[Candidate]) -> tuple[Candidate, ...]:
    """The NCCL-family candidates on every GPU left (the widest candidates' replicas), which
    an estimate never ranks below fewer GPUs: empty when the widest candidates left are not of
    the family (then only degraded options are left across those GPUs)."""
    widest = max((c.num_replicas for c in cands if c.backend != "cpu"), default=0)
    if widest <= 1:
        return ()
    return tuple(c for c in cands if nccl_family(c) and c.num_replicas == widest)


# --------------------------------------------------------------------------------------------
# Ranking (the cost model is estimate.py)
# --------------------------------------------------------------------------------------------
def rank_candidates(
    cands: list[Candidate],
    facts: Facts,
    results: Mapping[str, ProbeResult],
    policy: Options,
    b: Build,
    measured: MeasuredStep | None = None,
) -> list[Ranked]:
    """``measured``: the user's own step, measured (it stands over ``sample_seconds=``); only a
    measured compute lets an estimate rank fewer GPUs above an NCCL-family candidate on every
    GPU (`every_gpu_kept`)."""
    ranked = [Ranked(c, estimate(c, facts, results.get(c.key), policy, measured),
                     results.get(c.key)) for c in cands]
    order = {c.key: i for i, c in enumerate(cands)}
    _, compute = compute_source(policy, measured)
    kept = every_gpu_kept(cands)
    keeping = {c.key for c in kept} if compute == "none" else set()

    # sharding="full" is the user's choice: a candidate that does not shard (one device)
    # stays a fallback, below every sharded one, whatever its estimate
    asked_to_shard = policy.sharding == "full" and any(c.sharded for c in cands)

    def key(r: Ranked) -> tuple[int, int, float, int]:
        c = r.candidate
        group = 3 if c.backend == "cpu" else (0 if policy.prefer == c.backend else 1)
        if group == 1 and asked_to_shard and not c.sharded:
            group = 2
        # nothing measured the compute: every GPU an NCCL-family candidate may prove is kept
        return (group, 0 if c.key in keeping else 1, r.estimate.step_seconds, order[c.key])

    ranked.sort(key=key)
    ranked = _within_noise_keep_order(ranked, order, {r.candidate.key: key(r)[:2] for r in ranked}, b)
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
        else "pass gradient_bytes= or model= for the communication's real size"
    )
    cpu = [r.estimate.step_seconds for r in ranked if r.candidate.backend == "cpu"]
    cpu_last = bool(cpu) and any(r.estimate.step_seconds > cpu[0] for r in ranked
                                 if r.candidate.backend != "cpu")
    b.events.append(Ranking(
        tuple(RankEntry(r.candidate, r.estimate.step_seconds, r.estimate.basis) for r in ranked),
        basis, cpu_last, tuple(tried_first), known_size=policy.gradient_bytes is not None,
        compute=compute,
    ))
    _say_the_basis(ranked, kept, compute, b)
    return ranked


def _say_the_basis(ranked: Sequence[Ranked], kept: Sequence[Candidate], compute: str,
                   b: Build) -> None:
    """The trace of what the order rests on: provisional (nothing measured the compute, and
    what that kept), or fewer GPUs ranked first from a measured compute."""
    multi = [r for r in ranked if r.candidate.num_replicas > 1]
    if not multi:
        return
    if compute == "none":
        top = kept[0] if kept else None
        b.events.append(ProvisionalRanking(
            kept=top.devices if top is not None else (),
            replicas=top.num_replicas if top is not None else 0,
            degraded=top is None,
        ))
        return
    first = next((r.candidate for r in ranked if r.candidate.backend != "cpu"), None)
    widest = [c for c in kept if first is not None and c.num_replicas > first.num_replicas]
    if first is not None and widest:
        b.events.append(FewerGpusRanked(first, widest[0], compute))


def _node_local_order(ranked: list[Ranked], b: Build) -> list[Ranked]:
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


def _multi_worker_order(ranked: list[Ranked], b: Build) -> list[Ranked]:
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
    ranked: list[Ranked], order: Mapping[str, int], groups: Mapping[str, tuple[int, int]],
    b: Build,
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
            if groups[a.candidate.key] != groups[z.candidate.key]:  # prefer=, kept GPUs, CPU last
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


def choose(ranked: Sequence[Ranked], b: Build, policy: Options
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
