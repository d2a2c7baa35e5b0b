"""The Selection: what was chosen, why, and the handle to train with it.

Longer than ~450 lines on purpose: every public attribute and method of ``Selection`` lives
here, each with the docstring the API reference renders, so the class reads as its reference.

``scope()`` only enters what was chosen; it never decides again. The framework runtime (one
TensorFlow strategy object, or the PyTorch process group and helpers) is built on first use and
reused for the life of the Selection.

Longer than the house's ~450 lines on purpose: this is the public surface users read in one
place (the reference page renders it), each helper a few lines delegating to the runtime in
``frameworks/``; splitting it would split the one class a user learns.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from .core.call.model import gradient_bytes_of
from .core.call.options import Launch
from .core.measures.estimate import MeasuredStep
from .core.measures.probe import ProbeResult
from .core.planning.plan import Plan
from .core.trace.event import Event
from .core.values.candidate import Candidate
from .core.values.facts import Facts
from .core.values.human import brief, compose
from .errors import DryRunError, WrongFrameworkError

if TYPE_CHECKING:
    from .frameworks.checkpoint import Checkpointer
    from .frameworks.stepmeter import StepMeasurement
    from .records.handoff import TrainingReporter

__all__ = ["Launch", "Selection"]

T = TypeVar("T")
log = logging.getLogger("resilient_strategy")

#: The most characters of [Selection.summary][resilient_strategy.selection.Selection.summary]'s line.
SUMMARY_CHARS = 160
#: The most lines, and characters per line, of the short
#: [Selection.explain][resilient_strategy.selection.Selection.explain].
EXPLAIN_LINES = 8
EXPLAIN_CHARS = 160
#: What ends a short line that left a part out: where the rest is (the short explain names
#: what was ruled out and why; the verbose one has every event).
SUMMARY_MORE = " (sel.explain())"
EXPLAIN_MORE = " (sel.explain(verbose=True))"
#: The words of [Selection.decided_by][resilient_strategy.selection.Selection.decided_by].
DECIDED_BY = ("simulation", "run", "dry_run", "cache", "probe", "no_collective", "unproven")


class _Once(Generic[T]):
    """Builds a value on first ``get()`` and returns the same object ever after (thread-safe)."""

    def __init__(self, build: Callable[[], T]) -> None:
        self._build = build
        self._lock = threading.Lock()
        self._value: list[T] = []

    def get(self) -> T:
        with self._lock:
            if not self._value:
                self._value.append(self._build())
            return self._value[0]

    @property
    def built(self) -> bool:
        return bool(self._value)


@dataclass(frozen=True)
class Selection:
    """The decision, with everything needed to train on it."""

    candidate: Candidate
    """What was chosen: the framework, backend, devices, replicas, batch split and the
    variables it needs (`candidate.label` says it in words)."""
    plan: Plan
    """The planner's answer: the candidates in the order they are tried (`ranked`), those ruled
    out and why (`ruled_out`), the rules that fired, the warnings, and the typed trace events
    (`events`) that [explain][resilient_strategy.selection.Selection.explain] renders."""
    facts: Facts
    """The machine it decided for: GPUs, links, driver, host and installed frameworks, as read
    (or described, in a simulation), a frozen value."""
    env: Mapping[str, str]
    """The variables this library set for the choice (never one the user had set)."""
    results: Mapping[str, ProbeResult]
    """Every probe result the decision used, by candidate key: fresh or from the cache."""
    from_cache: bool = False
    """Whether the decision came from what probes proved before (the cache): nothing was
    probed this time. `probe="force"` probes again."""
    proven: bool = True
    """False when probing was off (or its budget spent) and a candidate with a collective was
    chosen without a probe proving it."""
    launch: Launch = field(default_factory=Launch)
    """Where this process sits in the launcher's job: rank, local rank, world size."""
    process_group_timeout: float = 300.0
    """Seconds a training collective may wait for a peer (the PyTorch process group's timeout;
    TensorFlow across workers)."""
    checkpoint_async: bool = True
    """PyTorch: whether `checkpoint` writes in the background by default
    (``RESILIENT_STRATEGY_CHECKPOINT_ASYNC``; its ``asynchronous=`` overrides)."""
    precision: str = "auto"
    """The precision policy of the PyTorch helpers: "auto", "bf16", "fp16" or "fp32"."""
    logical_cpus: int = 0
    """TensorFlow's CPU test mode: replicas on this many logical CPU devices (0: off)."""
    tf_workers: int = 1
    """TensorFlow under a multi-worker `TF_CONFIG`: the number of workers (1 otherwise)."""
    tf_worker_rank: int = 0
    """TensorFlow under a multi-worker `TF_CONFIG`: this worker's index (the chief is 0)."""
    dry_run: bool = False
    """Decided with `dry_run=True`: nothing was probed, set or built; training raises
    `DryRunError`."""
    decided_in_s: float = 0.0
    """Wall-clock seconds the decision took (inspecting, probing, planning)."""
    env_applied: bool = True
    """False when the decision was made for a given `env=` or a dry run: `os.environ` was not
    touched, and [env][resilient_strategy.selection.Selection.env] says what would be set."""
    simulated: bool = False
    """Whether the probe outcomes came from a described machine (the testing kit, `--simulate`),
    not from probes run here."""
    bound_ordinal: int | None = None
    """Where the scheduler bound this process to GPUs of its own (SLURM's
    ``--gpus-per-task``): the CUDA ordinal, in this process's own numbering, of the GPU it
    trains on; `devices` then number the node's GPUs, one per local rank. None where every
    local rank sees the same GPUs (torchrun: local rank i trains on ``devices[i]``)."""
    advise: Callable[[int], str | None] | None = field(default=None, repr=False, compare=False)
    """Given the model's measured gradient bytes, advice when another candidate would be faster
    (used by `prepare()`); None when the model's size was given up front."""
    progress: TrainingReporter | None = field(default=None, repr=False, compare=False)
    """Under `resilient-strategy run`: this rank's progress reports to the supervisor (None
    otherwise)."""
    rerank: Callable[[MeasuredStep, int, int | None], Plan] | None = field(
        default=None, repr=False, compare=False)
    """The planner again, given the user's step measured during training (its compute), the
    model's gradient bytes (0: as decided) and the global batch (None: as decided): the ranking
    the measured step compares the chosen candidate with (`frameworks.stepmeter`). None: no
    comparison (a dry run, a Selection built by hand)."""
    _runtime: _Once[Any] = field(init=False, repr=False, compare=False)
    _measured: list[Event] = field(init=False, default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_runtime", _Once(self._build_measured_runtime))

    # ----- the decision --------------------------------------------------------------------
    @property
    def framework(self) -> str:
        """"torch" or "tensorflow"."""
        return self.candidate.framework

    @property
    def backend(self) -> str:
        """What trains: "nccl", "gloo", "hierarchical_copy", "reduction_to_one_device",
        "mw_nccl", "mw_ring", "mw_auto", "single_device" or "cpu"."""
        return self.candidate.backend

    @property
    def devices(self) -> tuple[int, ...]:
        """The GPUs it trains on, as this job numbers them (empty on CPU)."""
        return self.candidate.devices

    @property
    def num_replicas(self) -> int:
        """Model replicas that train in step (GPUs, processes, or TF_CONFIG workers' devices)."""
        return self.candidate.num_replicas

    @property
    def accumulation_steps(self) -> int:
        """Micro-batches per optimizer step (more than 1 when a fallback keeps the batch)."""
        return self.candidate.accumulation_steps

    @property
    def global_batch_size(self) -> int | None:
        """Samples per optimizer step, all replicas and micro-steps together (as asked)."""
        return self.candidate.global_batch_size

    @property
    def per_replica_batch_size(self) -> int | None:
        """Samples per replica per micro-step."""
        return self.candidate.per_replica_batch_size

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over the replicas (PyTorch FSDP2), not replicated."""
        return self.candidate.sharded

    @property
    def offload(self) -> bool:
        """Whether the sharded model's state lives in host memory (FSDP2 CPUOffloadPolicy)."""
        return self.candidate.offload

    @property
    def active(self) -> bool:
        """False on the ranks a launcher started that the choice leaves idle (one-device
        fallback under torchrun trains on rank 0 only), and on the TF_CONFIG workers other than
        worker 0 when it trains alone (on one device, or under MirroredStrategy over its own
        GPUs)."""
        if self.tf_workers > 1 and self.framework == "tensorflow":
            from .vocab import MULTI_WORKER_BACKENDS

            return self.backend in MULTI_WORKER_BACKENDS or self.tf_worker_rank == 0
        if self.launch.launched and self.num_replicas == 1:
            return self.launch.rank == 0
        if self.framework == "torch" and self.launch.launched \
                and self.num_replicas < self.launch.world_size:  # FSDP over fewer GPUs
            return self.launch.rank < self.num_replicas
        return True

    @property
    def multi_worker(self) -> bool:
        """A TensorFlow multi-worker job (TF_CONFIG with 2+ chief/worker tasks)."""
        return self.tf_workers > 1

    @property
    def is_main_process(self) -> bool:
        """Rank 0 (of the launcher, and worker 0 of a TF_CONFIG job): log and save there."""
        return self.launch.rank == 0 and self.tf_worker_rank == 0

    @property
    def world_size(self) -> int:
        """The processes that train under this decision: PyTorch: the launcher's processes when
        the choice runs a process group, else 1 (a one-device fallback trains on rank 0 alone);
        TensorFlow: the TF_CONFIG workers when the strategy spans them, else 1 (one process
        drives every local replica). Not [num_replicas][resilient_strategy.selection.Selection.num_replicas]: a TensorFlow process can drive
        several replicas."""
        if self.framework == "tensorflow":
            from .vocab import MULTI_WORKER_BACKENDS

            return self.tf_workers if self.backend in MULTI_WORKER_BACKENDS else 1
        return min(self.launch.world_size, self.num_replicas) if self.num_replicas > 1 else 1

    @property
    def rank(self) -> int:
        """This process's rank: the launcher's ``RANK`` (PyTorch), the worker's index in
        ``TF_CONFIG`` (TensorFlow), 0 for a plain ``python`` run. On a rank the decision leaves
        idle ([active][resilient_strategy.selection.Selection.active] False) it is at least [world_size][resilient_strategy.selection.Selection.world_size]."""
        return self.tf_worker_rank if self.framework == "tensorflow" else self.launch.rank

    @property
    def local_rank(self) -> int:
        """This process's rank on its node (the launcher's ``LOCAL_RANK``; 0 for TensorFlow,
        which runs one process per worker, and for a plain ``python`` run)."""
        return 0 if self.framework == "tensorflow" else self.launch.local_rank

    @property
    def batch_size(self) -> int | None:
        """The batch to feed per step: TF: the global batch of one step across replicas (Keras
        splits it); torch: this rank's micro-batch. Accumulation makes up the rest."""
        per = self.per_replica_batch_size
        if per is None:
            return None
        return per * self.num_replicas if self.framework == "tensorflow" else per

    @property
    def handed_down(self) -> bool:
        """Whether `resilient-strategy run` decided this before its workers started (this
        process is one of them and took its decision as handed down)."""
        return any(getattr(e, "topic", "") == "handed_down" for e in self.plan.events)

    @property
    def decided_by(self) -> str:
        """How the choice was made, one word of `DECIDED_BY`: "simulation" (a described
        machine), "run" (handed down by `resilient-strategy run`), "dry_run", "cache" (what
        probes proved before), "probe" (its probe passed now), "no_collective" (nothing to
        prove), "unproven" (probing was off, or its budget spent). Exactly one, so a relaunched
        worker never says both "cache" and "run"."""
        if self.simulated:
            return "simulation"
        if self.handed_down:
            return "run"
        if self.dry_run:
            return "dry_run"
        if self.from_cache:
            return "cache"
        how = getattr(self._chosen_event(), "how", "")
        if how == "probe_passed":
            return "probe"
        if how == "no_collective":
            return "no_collective"
        if not self.proven or how in ("multi_node", "probing_off", "rounds_spent"):
            return "unproven"
        return "probe"

    def _chosen_event(self) -> Any:
        return next((e for e in self.plan.events if getattr(e, "kind", "") == "chosen"), None)

    def _how(self) -> str:
        by = self.decided_by
        if by == "probe":
            result = getattr(self._chosen_event(), "result", None)
            return (f"its probe passed in {result.elapsed_s:.1f} s" if result is not None
                    else "proven by its probe")
        return {
            "simulation": "simulated (nothing ran here)",
            "run": "decided by `resilient-strategy run`",
            "dry_run": "dry run: nothing was set or built",
            "cache": "from the cache (probe='force' re-probes)",
            "no_collective": "no collective to prove",
            "unproven": "UNPROVEN: probing was off or its budget spent",
        }[by]

    def summary(self, *, limit: int = SUMMARY_CHARS) -> str:
        """The decision in one line of at most ``limit`` (`SUMMARY_CHARS`) characters: what
        trains, the batch split, how it was decided (probe, cache, `resilient-strategy run`,
        dry run), the candidate it fell back from, and how long deciding took, the parts that
        fit by importance, never a cut one (the line then ends with where the rest is). What a script prints by
        default (``sel.print(sel.summary())``, and the Lightning and Accelerate helpers);
        [explain][resilient_strategy.selection.Selection.explain] says why."""
        c = self.candidate
        head = f"resilient_strategy chose: {c.label}"
        if self.per_replica_batch_size is not None and (
                self.num_replicas > 1 or self.accumulation_steps > 1):
            head += (f" ({self.num_replicas} x {self.per_replica_batch_size} x "
                     f"{self.accumulation_steps} = global batch {self.global_batch_size})")
        # what trains (the head), then by importance: the candidate it fell back from, an
        # idle rank, how it was decided, how long that took; whole parts, never a cut one
        parts: list[tuple[int, str]] = [(2, self._how())]
        failed = [r.candidate.label for r in self.plan.ruled_out
                  if r.rule == "probe" and r.candidate.key != c.key]
        if failed:
            parts.append((0, f"after {failed[0]} failed" + (f" (+{len(failed) - 1} more)"
                                                              if len(failed) > 1 else "")))
        if not self.active:
            who = (f"worker {self.tf_worker_rank}" if self.multi_worker
                   else f"rank {self.launch.rank}")
            parts.append((1, f"{who} stays idle"))
        if not self.handed_down:
            parts.append((3, f"decided in {self.decided_in_s:.2f} s"))
        return compose(parts, limit, head=f"{head}: ", more=SUMMARY_MORE)

    def explain(self, verbose: bool = False) -> str:
        """The decision and its reasons, as text.

        Short by default (at most `EXPLAIN_LINES` lines of at most
        `EXPLAIN_CHARS` characters): the one-line [summary][resilient_strategy.selection.Selection.summary],
        what was ruled out and why, the advice that applies, the variables set, and where the
        full reasoning is. ``verbose=True``: every event of the trace rendered, one line each
        (the same text ``python -m resilient_strategy plan`` prints; ``to_dict()`` / ``--json``
        carry the typed events)."""
        if verbose:
            return self._explain_verbose()
        lines = [self.summary()]
        budget = EXPLAIN_LINES - 2  # the summary, and the pointer to the full reasoning
        grouped: dict[str, list[str]] = {}  # one line per reason, its candidates named
        for r in self.plan.ruled_out:
            if r.candidate.key != self.candidate.key:
                why = f"rule {r.rule}: {r.reason}" if r.rule and r.rule not in (
                    "probe", "memory") else r.reason
                grouped.setdefault(why, []).append(r.candidate.label)
        reasons = list(grouped.items())
        for i, (why, labels) in enumerate(reasons):
            if budget <= 1 and i < len(reasons) - 1:
                lines.append(f"ruled out: {len(reasons) - i} more reasons (sel.explain(verbose=True))")
                budget -= 1
                break
            more = f" and {len(labels) - 1} more" if len(labels) > 1 else ""
            lines.append(brief(why, EXPLAIN_CHARS, head=f"ruled out {labels[0]}{more}: ",
                               more=EXPLAIN_MORE))
            budget -= 1
            if budget <= 0:
                break
        if self.env and budget > 0:
            verb = "set" if self.env_applied else "would set"
            lines.append(compose([f"{k}={v}" for k, v in sorted(self.env.items())],
                                 EXPLAIN_CHARS, head=f"{verb}: ", sep=" ", more=EXPLAIN_MORE))
            budget -= 1
        for advice in self.plan.warnings:
            if budget <= 0:
                break
            lines.append(brief(advice, EXPLAIN_CHARS, head="advice: ", more=EXPLAIN_MORE))
            budget -= 1
        lines.append("full reasoning: sel.explain(verbose=True), or `python -m resilient_strategy "
                     "plan` (--json for data)")
        return "\n".join(lines)

    def _explain_verbose(self) -> str:
        head = f"resilient_strategy chose: {self.candidate.label}"
        if self.num_replicas > 1 or self.accumulation_steps > 1:
            head += f" ({self.num_replicas} replica(s) x {self.accumulation_steps} accumulation step(s))"
        extras = []
        if self.simulated:
            extras.append("SIMULATED: decided for a described machine; every probe outcome and "
                          "time comes from the description, nothing ran here")
        if self.from_cache and not self.handed_down:
            extras.append("decision from the cache (probe='force' re-probes)")
        if not self.proven and not self.dry_run:
            extras.append("NOT proven: probing was off")
        if self.env:
            text = " ".join(f"{k}={v}" for k, v in sorted(self.env.items()))
            extras.append(
                f"set {text}" if self.env_applied else f"would set {text}"
                + ("" if self.dry_run else "; not applied: decided for a given env="))
        if self.dry_run:
            extras.append("dry run: nothing was set or built")
        if not self.active and self.multi_worker:
            extras.append(f"worker {self.tf_worker_rank} stays idle: only worker 0 trains")
        elif not self.active:
            extras.append(f"rank {self.launch.rank} stays idle: only rank 0 trains")
        extras.append(f"decided in {self.decided_in_s:.2f} s")
        lines = [head + "."] + [f"  ({e})" for e in extras] + ["Why:"]
        lines += [f"  - {t}" for t in self.plan.trace]
        return "\n".join(lines)

    @property
    def process_group_timeout_s(self) -> float:
        """Deprecated alias of [process_group_timeout][resilient_strategy.selection.Selection.process_group_timeout] (v0.2's name)."""
        return self.process_group_timeout

    def to_dict(self) -> dict[str, Any]:
        """The decision as JSON-able data (what ``--json`` prints), typed events included."""
        return {
            "framework": self.framework,
            "backend": self.backend,
            "label": self.candidate.label,
            "devices": list(self.devices),
            "num_replicas": self.num_replicas,
            "sharded": self.sharded,
            "offload": self.offload,
            "node_local": self.candidate.node_local,
            "accumulation_steps": self.accumulation_steps,
            "global_batch_size": self.global_batch_size,
            "per_replica_batch_size": self.per_replica_batch_size,
            "batch_size": self.batch_size,
            "env": dict(self.env),
            "env_applied": self.env_applied,
            "from_cache": self.from_cache,
            "proven": self.proven,
            "active": self.active,
            "dry_run": self.dry_run,
            "decided_in_s": round(self.decided_in_s, 4),
            "rank": self.rank,
            "local_rank": self.local_rank,
            "world_size": self.world_size,
            "launch_world_size": self.launch.world_size,
            "tf_workers": self.tf_workers,
            "tf_worker_rank": self.tf_worker_rank,
            "fingerprint": self.facts.fingerprint(),
            "rules_fired": list(self.plan.rules_fired),
            "warnings": list(self.plan.warnings),
            "candidates": [
                {**r.candidate.to_dict(), "estimated_step_s": round(r.estimate.step_seconds, 6),
                 "estimate_basis": r.estimate.basis}
                for r in self.plan.ranked
            ],
            "ruled_out": [
                {"key": r.candidate.key, "label": r.candidate.label, "reason": r.reason, "by": r.rule}
                for r in self.plan.ruled_out
            ],
            "probes": {k: v.to_dict() for k, v in self.results.items()},
            "trace": list(self.plan.trace),
            # the decision's events, then what training measured (`measured_events`)
            "events": [e.to_dict() for e in (*self.plan.events, *self._measured)],
            "measured_step": next((e.to_dict() for e in self._measured
                                   if e.kind == "step_measured"), None),
            "simulated": self.simulated,
        }

    # ----- the step, measured ----------------------------------------------------------------
    @property
    def measured_events(self) -> tuple[Event, ...]:
        """What training measured of this process's step (issue 41), once its window closed
        (`frameworks.stepmeter`: optimizer steps 6-25): a `StepMeasured`, and a
        `MeasuredFaster` when another candidate proven here would be clearly faster with those
        numbers (rank 0 logs its line). Empty before; in ``to_dict()["events"]`` after."""
        return tuple(self._measured)

    def _build_measured_runtime(self) -> Any:
        rt = self._build_runtime()
        meter = getattr(rt, "meter", None)
        if meter is not None:
            meter.on_done = self._step_measured
        return rt

    def _step_measured(self, m: StepMeasurement) -> None:
        """The window closed: its event; the planner asked again with the measured compute;
        and when a proven candidate would beat the measured step clearly, its event and line."""
        from .core.trace.measuring import MeasuredFaster, StepMeasured
        from .errors import ResilientStrategyError
        from .frameworks.stepmeter import FASTER_MARGIN, faster_candidate

        compute = m.sample_compute_s
        step = None if compute is None else MeasuredStep.of(compute, m.samples)
        update = m.update_s / m.steps
        self._measured.append(StepMeasured(
            self.candidate, m.first_step, m.steps, m.micro_steps, m.samples, m.step_s,
            m.compute_s, None if m.comm_wait_s is None else m.comm_wait_s / m.steps,
            None if m.comm_s is None else m.comm_s / m.steps,
            None if step is None else step.sample_seconds, m.how, m.gradient_bytes, m.note,
            update))
        if step is None or self.rerank is None or m.samples is None:
            self._note_measured(m.step_s)
            return
        batch = None if self.global_batch_size else round(
            m.samples / m.steps * self.num_replicas)
        try:
            again = self.rerank(step, m.gradient_bytes, batch)
        except (ResilientStrategyError, ValueError) as e:  # never a reason to stop training
            log.debug("resilient_strategy: the measured step was not ranked: %s", e)
            return
        found = faster_candidate(again.ranked, self.candidate.key, m.step_s, self.results,
                                 FASTER_MARGIN, update)
        if found is None:
            self._note_measured(m.step_s)
            return
        best, mine = found
        faster = best.estimate.step_seconds + update
        event = MeasuredFaster(
            self.candidate, m.step_s, best.candidate, faster,
            None if mine is None else mine.estimate.step_seconds + update,
            m.step_s / faster, FASTER_MARGIN, best.estimate.basis, step.sample_seconds,
            update)
        self._measured.append(event)
        if self.is_main_process:
            log.warning("resilient_strategy: %s", event.text())
        self._note_measured(m.step_s, best.candidate, faster)

    def _note_measured(self, step_s: float, faster: Candidate | None = None,
                       faster_step_s: float | None = None) -> None:
        """Under ``resilient-strategy run``, rank 0: the measured step (and the clearly faster
        candidate) noted for the supervisor, which may try it (`records.measured`)."""
        if self.progress is None or not self.is_main_process:
            return
        from .records.measured import MeasuredNote, note_measured_here

        # the optimizer step the window ended at: the runtime counts PyTorch's (restored ones
        # included); TensorFlow's runtime counts none, the reporter does (fit's batches, on
        # from BackupAndRestore's restored optimizer, `progress_callback`)
        at_step = self.optimizer_steps if self.framework == "torch" else self.progress.step
        note_measured_here(MeasuredNote(
            self.candidate.key, step_s, at_step,
            "" if faster is None else faster.key, "" if faster is None else faster.label,
            faster_step_s))

    # ----- the runtime ---------------------------------------------------------------------
    def _build_runtime(self) -> Any:
        if self.dry_run:
            raise DryRunError()
        if self.framework == "tensorflow":
            from .frameworks.tensorflow import TfRuntime

            # when we narrowed CUDA_VISIBLE_DEVICES to the chosen GPUs, TF numbers them 0..n-1
            narrowed = self.env_applied and "CUDA_VISIBLE_DEVICES" in self.env
            devices = tuple(range(len(self.devices))) if narrowed \
                else self.devices
            from .vocab import MULTI_WORKER_BACKENDS

            across = self.backend in MULTI_WORKER_BACKENDS
            return TfRuntime(
                self.backend, devices, self.accumulation_steps, self.global_batch_size,
                self.per_replica_batch_size, logical_cpus=self.logical_cpus,
                workers=self.tf_workers if across else 1,
                timeout_s=self.process_group_timeout if across else None,
            )
        from .frameworks.torch import TorchRuntime

        world = self.world_size
        return TorchRuntime(
            self.backend, self.devices, self.accumulation_steps, self.global_batch_size,
            self.per_replica_batch_size, rank=self.launch.rank if world > 1 else 0,
            local_rank=self.launch.local_rank if world > 1 else 0, world_size=world,
            timeout_s=self.process_group_timeout, precision=self.precision,
            sharded=self.candidate.sharded, offload=self.candidate.offload,
            own_device=self.bound_ordinal,
        )

    @property
    def runtime(self) -> Any:
        """The framework runtime (TfRuntime / TorchRuntime), built once on first use."""
        return self._runtime.get()

    @property
    def strategy(self) -> Any:
        """TensorFlow: the one tf.distribute strategy object (built on first access)."""
        if self.framework != "tensorflow":
            raise WrongFrameworkError("sel.strategy is TensorFlow's; PyTorch uses prepare()/scope()")
        return self.runtime.strategy

    def _leave_if_idle(self) -> None:
        """On a rank this decision leaves idle, end the process cleanly (exit status 0, which
        torchrun counts as done) instead of letting it train a duplicate of rank 0's work."""
        if self.active:
            return
        if self.multi_worker:
            log.warning(
                "resilient_strategy: worker %d of %d has nothing to do under this decision: no "
                "strategy across the TF_CONFIG workers was proven that beats worker 0 alone, so "
                "worker 0 trains alone (%s first, keeping the global batch); exiting cleanly "
                "(status 0). Check `sel.active` to end the worker yourself.",
                self.tf_worker_rank, self.tf_workers, self.candidate.label,
            )
        else:
            log.warning(
                "resilient_strategy: rank %d has nothing to do under this decision (%s trains "
                "on rank%s alone); exiting cleanly. Check `sel.active` to end the rank yourself.",
                self.launch.rank, self.candidate.label,
                " 0" if self.num_replicas == 1 else f"s 0-{self.num_replicas - 1}",
            )
        with contextlib.suppress(Exception):
            self.shutdown()
        raise SystemExit(0)

    @contextlib.contextmanager
    def scope(self) -> Iterator[Selection]:
        """Build (and compile, and load weights of) the model inside this."""
        self._leave_if_idle()
        if self.framework == "torch":
            rt = self.runtime
            self._init(rt)
            with rt.scope():
                yield self
        else:
            with self.runtime.scope():
                yield self

    # TensorFlow helpers
    def optimizer_kwargs(self, learning_rate: Any = None) -> dict[str, Any]:
        """Pass to a Keras 3 optimizer: gradient accumulation on the one-device fallback, and
        ``learning_rate`` (a float or a Keras schedule; a schedule is wrapped so it advances per
        optimizer update, not per micro-batch, exactly as under the strategy it replaces)."""
        if self.framework != "tensorflow":
            return {} if learning_rate is None else {"learning_rate": learning_rate}
        return dict(self.runtime.optimizer_kwargs(learning_rate=learning_rate))

    def wrap_optimizer(self, optimizer: Any) -> Any:
        """TensorFlow: give an existing (unbuilt) Keras 3 optimizer this selection's gradient
        accumulation and per-update learning-rate schedule; returns it."""
        self._tensorflow_only("wrap_optimizer")
        return self.runtime.wrap_optimizer(optimizer)

    def load_model(self, path: Any, **kwargs: Any) -> Any:
        """TensorFlow: ``keras.models.load_model(path, **kwargs)`` in the scope, the loaded
        optimizer then given this decision's gradient accumulation with its state kept, so a
        full-model checkpoint saved under another strategy (2 mirrored replicas, or the
        accumulating fallback) resumes on this one
        (``TfRuntime.load_model`` in ``resilient_strategy.frameworks.tensorflow``)."""
        self._tensorflow_only("load_model")
        self._leave_if_idle()
        return self.runtime.load_model(path, **kwargs)

    def callbacks(self, backup_dir: str | None = None, *,
                  save_freq: str | int = "epoch") -> list[Any]:
        """TensorFlow: Keras callbacks for ``fit`` that check, before the first step, that the
        compiled optimizer accumulates as this selection needs (else the global batch would
        silently be smaller); under ``resilient-strategy run``, one that reports each step's
        progress to the supervisor; with ``backup_dir``, Keras' own ``BackupAndRestore`` there
        (``save_freq``: "epoch" or every N batches), so a relaunch resumes where it stopped;
        and, until it measured, one that measures the step over a window of batches
        ([measured_events][resilient_strategy.selection.Selection.measured_events])."""
        self._tensorflow_only("callbacks")
        out = list(self.runtime.callbacks())
        if backup_dir is not None:
            import keras

            out.append(keras.callbacks.BackupAndRestore(backup_dir, save_freq=save_freq))
        if self.progress is not None:
            from .frameworks.tensorflow import progress_callback

            out.append(progress_callback(self.progress, self.accumulation_steps, backup_dir))
        if self.runtime.meter.live:  # the step measured once (`measured_events`)
            from .frameworks.tensorflow import measure_callback

            out.append(measure_callback(self.runtime.meter, self.accumulation_steps,
                                        self.per_replica_batch_size))
        return out

    def check_optimizer(self, model_or_optimizer: Any) -> None:
        """TensorFlow: raise InvalidOptionError when the optimizer does not accumulate as needed."""
        self._tensorflow_only("check_optimizer")
        self.runtime.check_optimizer(model_or_optimizer)

    def _tensorflow_only(self, what: str) -> None:
        if self.framework != "tensorflow":
            raise WrongFrameworkError(f"{what}() is TensorFlow's; PyTorch uses prepare()/step()")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` on the main process only (rank 0), like Accelerate's ``accelerator.print``:
        under torchrun, one copy of the output instead of one per rank, interleaved."""
        if self.is_main_process:
            print(*args, **kwargs)

    # PyTorch helpers
    @property
    def device(self) -> Any:
        """PyTorch: this process's ``torch.device`` (TensorFlow places through ``scope()``)."""
        if self.framework != "torch":
            raise WrongFrameworkError(
                "sel.device is PyTorch's; with TensorFlow, build the model inside sel.scope() "
                "and feed batches of sel.batch_size (the global batch): the strategy places them")
        return self.runtime.device

    def prepare(
        self, model: Any = None, optimizer: Any = None, loader: Any = None, *,
        shard_modules: Any = None, **ddp_kwargs: Any
    ) -> Any:
        """Move and wrap the model (DDP when replicas > 1; ``ddp_kwargs`` such as
        ``find_unused_parameters=True`` go to DistributedDataParallel); shard the loader
        (DistributedSampler, reshuffled by [set_epoch][resilient_strategy.selection.Selection.set_epoch]); return all three. Call it again
        for more loaders (``prepare(None, None, val_loader)``).

        When the decision shards ([sharded][resilient_strategy.selection.Selection.sharded]), FSDP2's ``fully_shard`` is applied to the
        modules of the classes in ``shard_modules`` (default: the model's repeated blocks), then
        the root, and the optimizer follows the sharded parameters; keyword arguments go to
        ``fully_shard`` then. ``shard_modules`` is ignored when the decision replicates."""
        self._leave_if_idle()
        if model is not None and self.advise is not None and self.is_main_process:
            advice = self.advise(gradient_bytes_of(model))
            if advice:
                log.warning("resilient_strategy: %s", advice)
        rt = self.runtime
        self._init(rt)
        out = rt.prepare(model, optimizer, loader, shard_modules=shard_modules, **ddp_kwargs)
        if self.progress is not None and rt.optimizer_steps:
            self.progress.restored(rt.optimizer_steps)
        return out

    def init_process_group(self) -> Selection:
        """PyTorch: start the decision's process group now, for a script that builds its own
        ``DistributedSampler(dataset)`` or calls ``torch.distributed`` before (or instead of)
        [prepare][resilient_strategy.selection.Selection.prepare]: the launcher's processes
        over the chosen backend, or, when the decision trains one process alone, a stand-in
        group of this process alone (world size 1, rank 0; `resilient_strategy.frameworks.
        solo_group`: no gloo, no socket). A rank the decision leaves idle exits here (status 0),
        before the script's own start-up. Idempotent; returns this Selection, so a script's
        ``init_process_group(backend="nccl")`` becomes
        ``sel = resilient_strategy.resilient_strategy(framework="torch").init_process_group()``."""
        if self.framework != "torch":
            raise WrongFrameworkError("init_process_group() is PyTorch's; TensorFlow builds "
                                      "its strategy in sel.scope()")
        self._leave_if_idle()
        self._init(self.runtime, stand_in=True)
        return self

    def adopt(self, model: Any, optimizer: Any, loader: Any = None, *,
              accumulates: bool = False, **ddp_kwargs: Any) -> tuple[Any, Any]:
        """PyTorch: ``(model, optimizer)`` for a loop of the script's own, which calls
        ``optimizer.zero_grad()``, ``loss.backward()`` and ``optimizer.step()`` itself: the
        model on this rank's device, a ``DistributedDataParallel`` or (one process alone) a
        module with its surface (``.module``, ``no_sync()``); the optimizer steps only on the
        last micro-step of each optimizer step and zeroes only between them, DDP skips the
        gradient sync on the others, and every micro-batch is checked against the decision's
        global batch (`GlobalBatchError`, never a smaller or larger step in silence). Starts the
        process group first ([init_process_group][resilient_strategy.selection.Selection.init_process_group]).
        ``loader``: the training loader (its own DistributedSampler kept), so that a step
        never spans two epochs. ``accumulates=True``: the loop accumulates itself, dividing
        its accumulation by ``torch.distributed.get_world_size()`` (nanoGPT); every step then
        applies and each is checked to see ``global_batch_size`` over the processes that train.
        ``ddp_kwargs`` go to ``DistributedDataParallel``. See
        `resilient_strategy.frameworks.adopted` and the how-to "adopt an existing DDP script"."""
        if self.framework != "torch":
            raise WrongFrameworkError("adopt() is PyTorch's; Keras uses sel.callbacks()")
        self._leave_if_idle()
        if self.advise is not None and self.is_main_process:
            advice = self.advise(gradient_bytes_of(model))
            if advice:
                log.warning("resilient_strategy: %s", advice)
        rt = self.runtime
        self._init(rt, stand_in=True)
        model, optimizer = rt.adopt(model, optimizer, loader, reporter=self.progress,
                                    accumulates=accumulates, **ddp_kwargs)
        return model, optimizer

    def _init(self, rt: Any, *, stand_in: bool = False) -> None:
        """Join the process group (a collective: reported as one under the supervisor);
        ``stand_in``: a group of this process alone when it trains alone."""
        rep = self.progress
        if rep is None or not rep.collective or rep.phase_name != "started":
            rt.init(stand_in=stand_in)
            return
        rep.setup_begin()
        rt.init(stand_in=stand_in)
        rep.setup_end()
        follow = getattr(rt, "device_progress", None)
        if follow is not None and rep.device is None:
            rep.device = follow(rep.writer, rep.step)

    def checkpoint(self, directory: str | Any, *, every_steps: int | None = None,
                   every_seconds: float | None = None,
                   asynchronous: bool | None = None) -> Checkpointer:
        """PyTorch: checkpoint to ``directory`` every ``every_steps`` optimizer steps and/or
        ``every_seconds`` seconds (default every 100 steps; rank 0 writes, atomically), and
        resume from it at [prepare][resilient_strategy.selection.Selection.prepare] (even with another number of replicas). Call it
        before [prepare][resilient_strategy.selection.Selection.prepare]; start the epoch loop at ``ckpt.epoch`` and call
        [set_epoch][resilient_strategy.selection.Selection.set_epoch] each epoch. ``asynchronous``
        (default: `checkpoint_async`, True unless ``RESILIENT_STRATEGY_CHECKPOINT_ASYNC=0``):
        the step pays for a copy of the state in host memory and a background thread writes
        it; False: the step writes it. See `resilient_strategy.frameworks.checkpoint`."""
        if self.framework != "torch":
            raise AttributeError("checkpoint() is PyTorch's; TensorFlow uses "
                                 "callbacks(backup_dir=...) (Keras BackupAndRestore)")
        from .frameworks.checkpoint import Checkpointer

        rt = self.runtime
        ckpt = Checkpointer(directory, every_steps=every_steps, every_seconds=every_seconds,
                            rank=rt.rank, world_size=rt.world_size,
                            asynchronous=self.checkpoint_async if asynchronous is None
                            else asynchronous, timeout_s=self.process_group_timeout,
                            local_ranks=self.launch.local_world_size or self.launch.world_size)
        rt.use_checkpointer(ckpt)
        return ckpt

    def resumed_from(self, step: int) -> None:
        """For a script that keeps its own checkpoint: report that it has just restored one of
        ``step`` optimizer steps (call it once, after loading it, before the first step; 0: it
        starts over). Under ``resilient-strategy run`` this is the proof of the resume: the
        relaunch is announced as resumed from ``step`` (``attempts.json``'s ``resumed_from``,
        the goodput's lost work) and the rank's step count goes on from it, so the crash-loop
        rule sees its progress. Without it such a relaunch counts as a start from step 0. The
        library's own restores (``sel.checkpoint``, Accelerate ``load_state``, Lightning's
        ``ckpt_path``, Keras ``BackupAndRestore``) report themselves. Outside ``run``: nothing."""
        from .errors import InvalidOptionError

        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise InvalidOptionError(f"sel.resumed_from({step!r}): the optimizer step count of "
                                     "the restored checkpoint, an int >= 0", "step")
        rep = self.progress
        if rep is None or step == 0:
            return
        if rep.has_stepped:
            raise InvalidOptionError(
                f"sel.resumed_from({step}) after this process's first optimizer step: report "
                "the restored step right after loading the checkpoint, before training", "step")
        rep.restored(step)

    @property
    def optimizer_steps(self) -> int:
        """PyTorch: optimizer steps taken (across relaunches when a checkpoint was restored)."""
        return int(self.runtime.optimizer_steps)

    def backward(self, loss: Any) -> None:
        """PyTorch: ``loss.backward()`` of ``loss / accumulation_steps`` (through the fp16
        GradScaler when there is one)."""
        rep = self.progress
        if rep is None:
            self.runtime.backward(loss)
            return
        last = self.runtime.is_last_micro_step
        rep.backward_begin(last)
        self.runtime.backward(loss)
        rep.backward_end(last)

    @property
    def is_last_micro_step(self) -> bool:
        """Whether the next [step][resilient_strategy.selection.Selection.step] applies the optimizer (gradients are complete then)."""
        return bool(self.runtime.is_last_micro_step)

    @property
    def scaler(self) -> Any:
        """PyTorch: the GradScaler of the fp16 policy, else None."""
        return self.runtime.scaler

    def clip_grad_norm(self, model: Any, max_norm: float, optimizer: Any, *,
                       norm_type: float = 2.0) -> Any:
        """Clip gradients on the last micro-step (unscaling fp16 ones first); the total norm
        before clipping, or None on micro-steps that only accumulate. Call before step()."""
        return self.runtime.clip_grad_norm(model, max_norm, optimizer, norm_type=norm_type)

    def step(self, optimizer: Any) -> bool:
        """PyTorch: end a micro-step; on the last one step the optimizer and zero the gradients.
        Returns whether it stepped (False on accumulating micro-steps and fp16-skipped steps)."""
        stepped = bool(self.runtime.step(optimizer))
        if self.progress is not None:
            # the stall of a save in this step, for the goodput's checkpoint part: told before
            # the step's marks (a save of the first step is start-up)
            self.progress.checkpoint_stalled(self.runtime.checkpoint_stall_s)
            self.progress.stepped(stepped)
        return stepped

    def accumulate(self, model: Any) -> Any:
        """PyTorch: a context for forward and backward; DDP syncs only on the last micro-step."""
        return self.runtime.accumulate(model)

    def autocast(self) -> Any:
        """PyTorch: the precision policy's autocast (bf16 / fp16), a no-op for fp32."""
        return self.runtime.autocast()

    def set_epoch(self, epoch: int) -> None:
        """PyTorch: reshuffle the shards of every prepared loader for ``epoch``."""
        self.runtime.set_epoch(epoch)

    def shutdown(self) -> None:
        """End the training: PyTorch: a barrier, then destroy the process group (also one that
        Lightning or Accelerate started). Idempotent. Forgotten, it happens at exit anyway
        (`resilient_strategy.frameworks.teardown`)."""
        if self._runtime.built and hasattr(self.runtime, "shutdown"):
            self.runtime.shutdown()
        elif self.framework == "torch" and not self.dry_run:
            from .frameworks.teardown import end_process_group

            end_process_group(self.process_group_timeout)
