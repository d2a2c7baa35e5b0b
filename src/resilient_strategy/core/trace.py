"""The trace of a decision as typed events (in the spirit of resolvelib's reporter).

Longer than ~450 lines on purpose: one frozen class per event kind, each with its ``text()``;
kept together so that the trace's vocabulary is one file.

The planner and the executor emit events; `render` turns them into the lines of
``explain()``, and `Event.to_dict` into the ``events`` of ``to_dict()``/``--json``. Tests
assert on events (their kind and fields), never on the English of a rendered line.

Every event is a frozen value. ``text()`` is one line, or "" for an event that another line
already says (a candidate a rule vetoed is named by that rule's line).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, ClassVar

from .candidate import Candidate
from .human import human_bytes, human_duration
from .memory import MemoryRow
from .probe import ProbeResult

__all__ = [
    "BatchSplit",
    "CachedFailure",
    "CandidateRuledOut",
    "Chosen",
    "Event",
    "FactsSeen",
    "FewerDevices",
    "FrameworkPicked",
    "MemoryChecked",
    "MultiWorkerDecided",
    "NextProbe",
    "Note",
    "NothingLeft",
    "OffloadConsidered",
    "RankEntry",
    "Ranking",
    "RemedyQueued",
    "RuleFired",
    "ShardingDecided",
    "Split",
    "UserSettingKept",
    "WorkerProbe",
    "render",
]


def _plain(value: Any) -> Any:
    if isinstance(value, Candidate):
        return {"key": value.key, "label": value.label}
    if isinstance(value, ProbeResult):
        return value.to_dict()
    if hasattr(value, "__dataclass_fields__"):
        return {f.name: _plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    return value


@dataclass(frozen=True)
class Event:
    """One thing the decision did or found."""

    kind: ClassVar[str] = "event"

    def text(self) -> str:
        raise NotImplementedError

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.kind}
        out.update({f.name: _plain(getattr(self, f.name)) for f in fields(self)})
        out["text"] = self.text()
        return out


def _env_text(env: Sequence[tuple[str, str]]) -> str:
    return " ".join(f"{k}={v}" for k, v in sorted(env))


# ----- facts and settings ------------------------------------------------------------------------
@dataclass(frozen=True)
class FrameworkPicked(Event):
    """Which framework the decision is for, and why."""

    kind: ClassVar[str] = "framework_picked"
    framework: str
    reason: str

    def text(self) -> str:
        return f"{self.reason}."


@dataclass(frozen=True)
class FactsSeen(Event):
    """What the planner saw: usable GPUs and the framework build."""

    kind: ClassVar[str] = "facts_seen"
    gpus: int
    names: tuple[str, ...]
    framework: str
    version: str | None
    cuda: str | None
    nccl: str | None
    #: the NVIDIA driver (rules key on driver.version); in the event and the JSON, while the
    #: line leaves it to the doctor's facts
    driver: str | None = None
    #: the HIP version of a ROCm build (not CPU-only: it runs AMD GPUs); None otherwise
    hip: str | None = None

    def text(self) -> str:
        gpu_text = f"{self.gpus} GPU(s) ({', '.join(self.names)})" if self.gpus else "no GPU"
        build = (f"CUDA {self.cuda}" if self.cuda else f"ROCm build, HIP {self.hip}" if self.hip
                 else "CPU-only build")
        nccl = f", NCCL {self.nccl}" if self.nccl else ""
        return (f"Saw {gpu_text}; {self.framework} {self.version or 'not installed'} "
                f"({build}{nccl}).")


@dataclass(frozen=True)
class Note(Event):
    """A finding that changes what is considered, named by ``topic``:

    ``no_gpu_facts``, ``visible_devices``, ``nvml_unread``, ``devices_asked``, ``logical_cpus``,
    ``cpu_only_build``, ``rocm_build``, ``too_few_gpus``, ``multi_node``, ``one_process``,
    ``no_global_batch``,
    ``batch_not_split``, ``batch_shrinks_replicas``, ``prefer_impossible``, ``fault_injection``
    (the cache is neither read nor written for a rehearsal), ``within_noise`` (measured speeds
    within their measured noise kept the chain's order), ``multi_worker`` (a TF_CONFIG job's
    ladder), ``alone_after_workers`` (worker 0's own MirroredStrategy moved after the strategies
    across the workers), ``handed_memory`` (a worker of ``resilient-strategy run`` takes the
    supervisor's sharding / offload), ``bound_devices`` (a worker bound to a subset of the GPUs:
    which ones), ``gpus_unchecked`` (GPUs a killed probe may have broken, unused by the choice,
    whose deferred health check did not fit the probe budget: how to check them),
    ``retried_after_check`` (a probe whose failure is no verdict by itself, NCCL out of GPU
    memory while setting up: its GPUs checked, then probed once more, and what that gave).
    """

    kind: ClassVar[str] = "note"
    topic: str
    message: str

    def text(self) -> str:
        return self.message


@dataclass(frozen=True)
class CachedFailure(Event):
    """A failure the cache remembers for ``candidate`` (``status``), seen in ``seen`` runs in a
    row: ``trusted`` (seen twice or more, or probing is off) or probed again (seen once: it may
    have been an overloaded machine)."""

    kind: ClassVar[str] = "cached_failure"
    candidate: str
    status: str
    seen: int
    trusted: bool

    def text(self) -> str:
        if not self.trusted:
            return (f"Cached failure of {self.candidate} ({self.status}) seen in one run only: "
                    "probing it again (one failure may be an overloaded machine).")
        return (f"Cached failure of {self.candidate} ({self.status}) trusted: seen in "
                f"{self.seen} run(s) in a row" + ("." if self.seen >= 2 else
                                                   ", and probing is off."))


# ----- rules ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RuleFired(Event):
    """A known-issue rule matched these facts, and what it did.

    ``action``: ``warn``, ``no_gpu`` (the chain planned without the GPUs), ``veto`` (``candidates`` ruled out), ``prefer`` (``targets`` first),
    ``set_env`` (``env`` set for NCCL), ``remedy_added`` (NCCL with ``env`` added, tried before
    plain NCCL when ``first``), ``remedy_exists`` (that remedy was a candidate already),
    ``nothing_to_act_on`` (no NCCL candidate left), ``already_ruled_out`` (an earlier rule
    removed its ``targets``; its advice still stands).
    """

    kind: ClassVar[str] = "rule_fired"
    rule: str
    effect: str
    action: str
    message: str
    source: str
    candidates: tuple[Candidate, ...] = ()
    targets: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    first: bool = False

    @property
    def cite(self) -> str:
        return f"[{self.rule}] {self.message} (source: {self.source})"

    def text(self) -> str:
        a = self.action
        if a == "warn":
            return f"Warning {self.cite}"
        if a == "no_gpu":
            return f"No GPU can run this build; planned without them: {self.cite}"
        if a == "veto":
            return f"Ruled out {'; '.join(c.label for c in self.candidates)}: {self.cite}"
        if a == "prefer":
            return f"Preferred {', '.join(self.targets)}: {self.cite}"
        if a == "set_env":
            return f"Set {_env_text(self.env)} for NCCL: {self.cite}"
        if a == "remedy_exists":
            return (f"Rule {self.rule} also suggests NCCL with {_env_text(self.env)}, already a "
                    f"candidate: {self.cite}")
        if a == "nothing_to_act_on":
            return f"Rule {self.rule} has nothing to act on: no NCCL candidate is left."
        if a == "already_ruled_out":
            return (f"Rule {self.rule} also applies to {', '.join(self.targets)}, already ruled "
                    f"out: {self.cite}")
        when = "before" if self.first else "after"
        return f"Added NCCL with {_env_text(self.env)}, tried {when} plain NCCL: {self.cite}"


@dataclass(frozen=True)
class UserSettingKept(Event):
    """A rule or remedy would set variables the user set: the user's values stand."""

    kind: ClassVar[str] = "user_setting_kept"
    rule: str
    variables: tuple[str, ...]

    def text(self) -> str:
        them = "it" if len(self.variables) == 1 else "them"
        return (f"Rule {self.rule} would set {', '.join(self.variables)}, but you set {them}; "
                "your value stands.")


# ----- candidates -------------------------------------------------------------------------------
@dataclass(frozen=True)
class CandidateRuledOut(Event):
    """A candidate left out, ``by`` a rule (``rule`` names it), a probe (``result``), or the
    batch arithmetic (``batch``). ``said`` when another line of the trace already says it."""

    kind: ClassVar[str] = "ruled_out"
    candidate: Candidate
    by: str
    reason: str
    rule: str = ""
    source: str = ""
    result: ProbeResult | None = None
    simulated: bool = False
    said: bool = False

    def text(self) -> str:
        if self.said:
            return ""
        if self.by == "probe" and self.result is not None:
            sim = " (simulated)" if self.simulated else ""
            return (f"Probe of {self.candidate.label} failed after {self.result.elapsed_s:.1f} s"
                    f"{sim}: {self.reason}.")
        return f"Ruled out {self.candidate.label}: {self.reason}."


@dataclass(frozen=True)
class ShardingDecided(Event):
    """Whether the multi-device candidates shard the model (FSDP2) or replicate it, and why:
    ``mode`` is the ``sharding=`` option; ``reason`` one of "asked" (``"full"``),
    "replica_does_not_fit", "replica_fits"; the bytes a replica needs per device
    against the smallest usable free memory of those devices (None: unknown). Emitted only when
    sharding was asked for or the sizes were known."""

    kind: ClassVar[str] = "sharding"
    mode: str
    sharded: bool
    reason: str
    replica_bytes: int | None = None
    sharded_bytes: int | None = None
    usable_bytes: int | None = None

    def text(self) -> str:
        if self.reason == "asked":
            return "Sharding the model over the replicas (FSDP2), as asked (sharding='full')."
        numbers = (f"a replica needs {human_bytes(self.replica_bytes or 0)} per device, "
                   f"{human_bytes(self.usable_bytes or 0)} is usable")
        if self.sharded:
            return (f"sharding='auto' shards the model (FSDP2): {numbers}; sharded it needs "
                    f"{human_bytes(self.sharded_bytes or 0)}.")
        return f"sharding='auto' replicates: {numbers}."


@dataclass(frozen=True)
class MemoryChecked(Event):
    """The memory each candidate needs per device against its devices' free memory; the
    candidates that do not fit are ruled out (``ruled_out`` events with ``by="memory"``)."""

    kind: ClassVar[str] = "memory_check"
    model: str  # the model's state, in words (memory.ModelMemory.describe)
    state_bytes: int
    rows: tuple[MemoryRow, ...]

    @property
    def does_not_fit(self) -> tuple[MemoryRow, ...]:
        return tuple(r for r in self.rows if r.fits is False)

    def text(self) -> str:
        return (f"Memory per device for {self.model} ({human_bytes(self.state_bytes)} in all): "
                + "; ".join(r.text() for r in self.rows) + ".")


@dataclass(frozen=True)
class FewerDevices(Event):
    """Every FSDP candidate over all ``widest`` GPUs is out (its probe failed, or it does not
    fit): the step-down shards over the largest subset of them that fits. ``rows``: FSDP over
    each subset size tried, largest first, on the GPUs with the most free memory (the last row
    the one chosen when it fits); ``unsplit``: sizes skipped because the global batch does not
    split over them."""

    kind: ClassVar[str] = "fewer_devices"
    widest: int
    rows: tuple[MemoryRow, ...]
    unsplit: tuple[int, ...] = ()

    @property
    def chosen(self) -> Candidate | None:
        last = self.rows[-1] if self.rows else None
        return last.candidate if last is not None and last.fits is not False else None

    def text(self) -> str:
        head = f"FSDP over all {self.widest} GPUs is out; stepping down to FSDP over fewer GPUs"
        skipped = (f" ({', '.join(map(str, self.unsplit))} GPUs skipped: the global batch does "
                   "not split over them)") if self.unsplit else ""
        tried = "; ".join(r.text() for r in self.rows)
        if self.chosen is None:
            return f"{head}{skipped}: no subset fits: {tried}."
        on = ",".join(map(str, self.chosen.devices))
        return (f"{head}{skipped}: {tried}; the step-down is FSDP on GPUs {on} (each backend of "
                "the chain), accumulating to keep the global batch.")


@dataclass(frozen=True)
class OffloadConsidered(Event):
    """No candidate that keeps the model's state on the GPUs is left. ``mode`` "auto": the
    offloaded candidates (FSDP2 ``CPUOffloadPolicy``) are planned where they fit; "none" (the
    user did not allow it): they are not, and ``would_fit`` says whether one would have.
    ``rows``: per candidate, its GPUs' row and the host's; ``costs``: per candidate, the
    estimated seconds per global batch its host copies and CPU optimizer step add."""

    kind: ClassVar[str] = "offload"
    mode: str
    rows: tuple[tuple[MemoryRow, MemoryRow], ...]
    costs: tuple[tuple[Candidate, float, float], ...] = ()

    @property
    def fitting(self) -> tuple[Candidate, ...]:
        return tuple(g.candidate for g, h in self.rows if g.fits is not False and h.fits is not False)

    @property
    def would_fit(self) -> bool:
        return bool(self.fitting)

    def text(self) -> str:
        rows = "; ".join(f"{g.text()}, and {h.text()}" for g, h in self.rows)
        if self.mode != "auto":
            if not self.would_fit:
                return f"Offloading the model's state to host memory would not fit either: {rows}."
            return ("No candidate that keeps the model's state on the GPUs fits; offloading it "
                    f"to host memory would ({rows}), but offload='none' (the default): pass "
                    "offload='auto' to allow it.")
        cost = "; ".join(f"{c.label}: about +{human_duration(copy_s + opt_s)} per global batch "
                         f"(host copies {human_duration(copy_s)}, optimizer step on the CPU "
                         f"{human_duration(opt_s)}, estimated)" for c, copy_s, opt_s in self.costs)
        return ("No candidate that keeps the model's state on the GPUs fits; offload='auto' "
                f"plans it in host memory (FSDP2 CPUOffloadPolicy): {rows}"
                + (f". Its cost: {cost}" if cost else "") + ".")


@dataclass(frozen=True)
class RemedyQueued(Event):
    """After plain NCCL failed with ``cause``, this remedy is tried next; ``on_top_of`` names
    the remedy that failed with that (new) cause, whose variables this one keeps."""

    kind: ClassVar[str] = "remedy_queued"
    candidate: Candidate
    cause: str
    on_top_of: Candidate | None = None
    #: the remedy's id in the remedies table, and the facts of this machine that made it
    #: apply (its ``when`` clauses, all of which held): why it was tried
    remedy: str = ""
    because: tuple[str, ...] = ()

    def text(self) -> str:
        why = f" (this machine: {', '.join(self.because)})" if self.because else ""
        if self.on_top_of is not None:
            return (f"Will try {self.candidate.label}: the remedy {self.on_top_of.label} failed "
                    f"on {self.cause}, so that cause's remedy is added on top{why}.")
        return f"Will try {self.candidate.label}, the usual remedy for {self.cause}{why}."


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
    whatever its estimate (``tried_first`` names those rules). ``known_size`` False: the
    script gave no model size (``gradient_bytes=`` / ``model=``), so the estimates are of an
    assumed model and the line names the order without their seconds."""

    kind: ClassVar[str] = "ranking"
    entries: tuple[RankEntry, ...]
    gradients: str
    cpu_last: bool = False
    tried_first: tuple[str, ...] = ()
    known_size: bool = True

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


def render(events: Sequence[Event]) -> tuple[str, ...]:
    """The lines of the trace: one per event that says something new."""
    return tuple(t for t in (e.text() for e in events) if t)
