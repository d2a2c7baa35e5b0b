"""How the candidates left were split, ranked and chosen: the batch split, the ranking, the next
probe, the choice (one node, or agreed across TensorFlow workers), nothing left."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from ..measures.probe import ProbeResult
from ..values.candidate import Candidate
from ..values.human import human_duration
from .event import Event


@dataclass(frozen=True)
class Split:
    backend: str
    replicas: int
    per_replica_batch: int | None
    accumulation_steps: int


@dataclass(frozen=True)
class BatchSplit(Event):
    """The global batch, kept exact on every candidate."""

    kind: ClassVar[str] = "batch_split"
    global_batch_size: int
    splits: tuple[Split, ...]

    def text(self) -> str:
        return (
            f"Global batch {self.global_batch_size} kept exact on every candidate (replicas x "
            "per-replica batch x accumulation steps): " + "; ".join(
                f"{s.backend} {s.replicas}x{s.per_replica_batch}x{s.accumulation_steps}"
                for s in self.splits
            ) + "."
        )


@dataclass(frozen=True)
class RankEntry:
    candidate: Candidate
    step_seconds: float
    basis: str


@dataclass(frozen=True)
class Ranking(Event):
    """The order candidates are tried in, with each one's estimated time per global batch.

    By estimate, except: a ``prefer``red backend first, CPU last (``cpu_last`` when that put it
    below a slower candidate), and a remedy a rule marks ``first`` right before plain NCCL
    whatever its estimate (``tried_first`` names those rules), and while nothing measured the
    compute, an NCCL-family candidate on every GPU above fewer GPUs (`ProvisionalRanking`).
    ``known_size`` False: the script gave no model size (``gradient_bytes=`` / ``model=``), so
    the estimates are of an assumed model and the line names the order without their seconds.
    ``compute``: where the estimates' compute came from (``measures.estimate.COMPUTE_SOURCES``:
    "measured_step", "sample_seconds", or "none": assumed, the ranking provisional)."""

    kind: ClassVar[str] = "ranking"
    entries: tuple[RankEntry, ...]
    gradients: str
    cpu_last: bool = False
    tried_first: tuple[str, ...] = ()
    known_size: bool = True
    compute: str = "none"

    def text(self) -> str:
        if not self.known_size:
            out = (f"Order of trial for a model of unknown size ({self.gradients}): "
                   + "; ".join(e.candidate.label for e in self.entries) + ".")
        else:
            head = "Ranked by estimated time per global batch" if not self.tried_first \
                else "Order of trial, with the estimated time per global batch"
            out = f"{head} ({self.gradients}): " + "; ".join(
                f"{e.candidate.label} ~{human_duration(e.step_seconds)} ({e.basis})"
                for e in self.entries
            ) + "."
        if self.tried_first:
            out += (f" Tried first whatever its estimate: the remedy of rule "
                    f"{', '.join(self.tried_first)}, before plain NCCL.")
        if self.cpu_last:
            out += (" CPU stays last whatever its estimate: it is the fallback of last resort, "
                    "and estimates of tiny models are noise.")
        return out


#: Why a ranking is provisional (``ProvisionalRanking.reason``): nothing measured the compute
#: of the user's step (no measured step, no ``sample_seconds=``), and a model's size is not its
#: compute (a FLOP count per parameter is one token's cost, not a sequence's or an image's).
PROVISIONAL_REASONS = ("no_compute_measured",)


@dataclass(frozen=True)
class ProvisionalRanking(Event):
    """The ranking rests on no measured compute, so it is provisional. ``kept``: the GPUs an
    NCCL-family candidate on every GPU keeps (``replicas`` of them): it ranks above every
    candidate on fewer GPUs whatever the estimates say. ``degraded``: no such candidate is left
    (none was in the chain, or each failed), so the estimate (with an assumed compute) chose
    among the degraded options, gloo across the GPUs or one GPU with accumulation, and the
    measured step confirms or corrects it."""

    kind: ClassVar[str] = "ranking_provisional"
    kept: tuple[int, ...]
    replicas: int
    degraded: bool
    reason: str = "no_compute_measured"

    def text(self) -> str:
        head = ("The ranking is provisional: nothing measured the compute of your step (a "
                "model's size is not its compute; pass sample_seconds= to rank by speed).")
        if self.degraded:
            return (head + " No NCCL-family candidate is left on every GPU, so the estimate, "
                    "with an assumed compute, orders the degraded options left.")
        gpus = ",".join(map(str, self.kept))
        where = f"GPUs {gpus}" if gpus else f"{self.replicas} replicas"
        return (head + f" Every GPU is kept: an NCCL-family candidate on {where} ranks above "
                "fewer GPUs whatever the estimate.")


@dataclass(frozen=True)
class FewerGpusRanked(Event):
    """A measured compute (``source``: "measured_step" or "sample_seconds", see
    ``measures.estimate.COMPUTE_SOURCES``) ranked ``candidate``, on fewer GPUs, above the
    NCCL-family candidate on every GPU (``over``)."""

    kind: ClassVar[str] = "fewer_gpus_ranked"
    candidate: Candidate
    over: Candidate
    source: str

    def text(self) -> str:
        what = ("your step as measured" if self.source == "measured_step"
                else "your sample_seconds=")
        return (f"{self.candidate.label} ranks above {self.over.label} ({self.over.num_replicas} "
                f"replicas) from {what}: with that compute, fewer GPUs are estimated faster.")


@dataclass(frozen=True)
class HostBusy(Event):
    """A probe of ``candidate`` was cut (deadline or stall) while the host was too busy to run
    it: its most starved worker got ``got`` of the CPU it wanted (``probing.cost.got_share``).
    ``retried_s``: the deadline it was retried with (scaled to that share), None when it was
    not; ``passed``: how the last run ended. A failure so marked is never cached (load is not
    a fault of the transport)."""

    kind: ClassVar[str] = "host_busy"
    candidate: Candidate
    got: float | None
    retried_s: float | None
    passed: bool

    def text(self) -> str:
        share = f" (its workers got {self.got:.0%} of the CPU they wanted)" \
            if self.got is not None else ""
        head = f"The host was busy while {self.candidate.label} was probed{share}"
        if self.retried_s is not None:
            head += f"; retried with a {human_duration(self.retried_s)} deadline"
        return head + (": it passed." if self.passed else
                       ": it still did not finish, which is not cached as a failure of the "
                       "transport.")


# ----- the choice -------------------------------------------------------------------------------
@dataclass(frozen=True)
class NextProbe(Event):
    kind: ClassVar[str] = "next_probe"
    candidate: Candidate

    def text(self) -> str:
        return f"Next: prove {self.candidate.label} with a live probe."


#: How a candidate was chosen (``Chosen.how``).
CHOSEN_HOW = ("probe_passed", "no_collective", "dry_run", "multi_node", "probing_off",
              "rounds_spent", "worker_0_alone")


@dataclass(frozen=True)
class Chosen(Event):
    """The choice. ``how`` is one of `CHOSEN_HOW`; ``result`` the probe that proved it."""

    kind: ClassVar[str] = "chosen"
    candidate: Candidate
    how: str
    result: ProbeResult | None = None
    simulated: bool = False
    max_rounds: int = 0

    def text(self) -> str:
        c, r = self.candidate, self.result
        if self.how == "probe_passed" and r is not None:
            bw = f", {r.bus_bandwidth_gbps:g} GB/s" if r.bus_bandwidth_gbps else ""
            sim = " (simulated)" if self.simulated else ""
            return f"Chose {c.label}: its probe passed in {r.elapsed_s:.1f} s{sim}{bw}."
        if self.how == "no_collective":
            return (f"Chose {c.label} with {c.accumulation_steps} accumulation step(s): no "
                    "collective to prove, and it ranks above every candidate left.")
        why = {
            "dry_run": "dry run: it would be probed first",
            "multi_node": "UNPROVEN: a multi-node job is not probed",
            "probing_off": "UNPROVEN, probing is off (probe='never')",
            "rounds_spent": f"UNPROVEN: the limit of {self.max_rounds} probes per decision is "
                            "used up",
            "worker_0_alone": "worker 0 trains alone from here on, proving its own GPUs (this "
                              "worker does not: it exits 0)",
        }[self.how]
        return f"Chose {c.label}: {why}."


@dataclass(frozen=True)
class WorkerProbe:
    """One candidate proven across the workers of a TF_CONFIG job, and how it went."""

    candidate: Candidate
    status: str  # ok / error / timeout
    cause: str
    why: str  # "" when ok, else the result's why()


@dataclass(frozen=True)
class MultiWorkerDecided(Event):
    """A TensorFlow multi-worker job's decision, as every worker's trace says it: the job, what
    was probed across the ``workers`` (every worker ran the same probes together; a last
    all-reduce made them agree on each verdict) and what was chosen. ``alone``: worker 0 trains
    alone, the others exit 0; ``active``: this worker trains."""

    kind: ClassVar[str] = "multi_worker"
    workers: int
    worker_rank: int
    task: str
    probed: tuple[WorkerProbe, ...]
    chosen: Candidate | None
    alone: bool
    active: bool
    proven: bool = True

    def text(self) -> str:
        head = (f"Multi-worker job: this is {self.task or 'worker ' + str(self.worker_rank)} "
                f"(worker {self.worker_rank} of {self.workers}).")
        if self.probed:
            head += f" Probed across {self.workers} workers: " + "; ".join(
                f"{p.candidate.label}: " + ("ok" if p.status == "ok" else f"failed ({p.why})")
                for p in self.probed) + "."
        elif self.proven:
            head += f" Nothing was probed across the {self.workers} workers (nothing needed it)."
        else:
            head += (f" Nothing was probed across the {self.workers} workers: the choice is "
                     "UNPROVEN (probing is off).")
        c = self.chosen
        if c is None:
            return head
        if self.alone and c.needs_probe and not self.active:
            tail = (f" Worker 0 trains alone, first trying {c.label} (its own probe decides, "
                    "one device after it); the other workers exit 0")
        elif self.alone:
            tail = (f" Worker 0 trains alone on {c.label} with {c.accumulation_steps} "
                    "accumulation step(s) keeping the global batch; the other workers exit 0")
            tail += "." if self.active else " (this one too)."
        else:
            tail = f" Chosen across all {self.workers} workers: {c.label}, {c.num_replicas} replicas."
        return head + tail


@dataclass(frozen=True)
class NothingLeft(Event):
    kind: ClassVar[str] = "nothing_left"

    def text(self) -> str:
        return "Nothing is left to try."
