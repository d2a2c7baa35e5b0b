"""The decision ``resilient-strategy run`` hands to its workers, and the workers' side of the run.

The supervisor decides once, writes the decision (the chosen candidate's key and the probe
results it was planned from) to a private JSON file, and starts each worker through
`resilient_strategy.run.worker` with that file's path. ``resilient_strategy()`` in the worker
finds it (`load_decision`), re-plans from the same results in milliseconds and takes the
handed candidate, so every rank agrees by construction and nothing is probed twice.

The worker then reports its progress (`TrainingReporter`, through
`resilient_strategy.records.progress`) from the Selection's training calls, acts on a rehearsed
fault (`resilient_strategy.records.trainfault`), and on an exception leaves an error record that
the supervisor classifies (`write_error`).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import TracebackType
from typing import Any

from ..core.knowledge.signatures import builtin_signatures
from ..core.measures.probe import ProbeResult
from ..core.values.bounded import parse_json, read_user_file
from ..core.values.candidate import Candidate, CandidateKey
from ..core.values.facts import Facts
from ..errors import InvalidOptionError, NoSpaceError, ResilientStrategyError
from ..machine import files
from ..process import PROCESS
from . import phases
from .progress import (
    COLLECTIVE,
    COLLECTIVE_DONE,
    COMM_READY,
    COMM_SETUP,
    FINISHED,
    STARTED,
    STEP_DONE,
    DevicePoller,
    ProgressWriter,
)
from .rundir import RunDir
from .trainfault import TrainFault, fault_from

#: Private: set by the worker wrapper in the worker's own process, never by the user.
DECISION_VAR = "RESILIENT_STRATEGY_DECISION"
#: A handed decision holds one plan's probe results: far below this.
MAX_DECISION_BYTES = 16 << 20
FORMAT_VERSION = 1


@dataclass(frozen=True)
class HandedDecision:
    """What the supervisor decided, for the workers of one launch attempt."""

    framework: str
    chosen: str  # candidate key
    results: Mapping[str, ProbeResult]
    run_dir: str  # progress and error records of this attempt
    attempt: int = 0
    proven: bool = True
    from_cache: bool = False
    notes: tuple[str, ...] = ()  # the supervisor's story so far (relaunches), for explain()
    global_batch_size: int | None = None
    label: str = ""  # the chosen candidate in words
    processes: int = 1  # workers this decision needs on this node
    nodes: int = 1  # nodes that train on it (1 under --nnodes N: node 0 alone)
    node_trace: tuple[str, ...] = ()  # how the nodes agreed (multi-node), for explain()
    #: The supervisor's Plan.reference_replicas: the worker splits the batch as it did.
    reference_replicas: int = 1
    #: The memory planning the supervisor decided with (``--sharding`` / ``--offload``, or
    #: their defaults; None: not planned, as in a decision of an older version), and the flags
    #: given on its command line: the script's resilient_strategy() must agree with them.
    sharding: str | None = None
    offload: str | None = None
    flags: tuple[str, ...] = ()
    #: The GPUs (the supervisor's CUDA ordinals) the workers are bound to, when the decision is
    #: over a subset that is not the first GPUs (FSDP over the GPUs with the most free memory);
    #: ``visible_devices`` is the CUDA_VISIBLE_DEVICES each worker gets for it (within the
    #: user's own list when they set one). Empty: the workers see what the supervisor sees.
    devices: tuple[int, ...] = ()
    visible_devices: str = ""
    #: The memory the decision was planned against: each GPU's free bytes (by the supervisor's
    #: ordinal; None: unknown) and the host's available bytes. The worker plans with them, not
    #: with what it reads later (its peers may have started CUDA by then), so its memory checks
    #: are the supervisor's.
    free_bytes: tuple[int | None, ...] = ()
    host_available_bytes: int | None = None
    #: Who started the supervisor (`core.values.launcher.RunLaunch.launcher`: ``slurm`` for an
    #: srun task; empty: the command line alone) and what it read from it, in one line.
    launcher: str = ""
    launched_by: str = ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION, "framework": self.framework, "chosen": self.chosen,
            "results": {k: v.to_dict() for k, v in self.results.items()},
            "run_dir": self.run_dir, "attempt": self.attempt, "proven": self.proven,
            "from_cache": self.from_cache, "notes": list(self.notes),
            "global_batch_size": self.global_batch_size, "label": self.label,
            "processes": self.processes, "nodes": self.nodes,
            "node_trace": list(self.node_trace),
            "reference_replicas": self.reference_replicas,
            "sharding": self.sharding, "offload": self.offload, "flags": list(self.flags),
            "devices": list(self.devices), "visible_devices": self.visible_devices,
            "free_bytes": list(self.free_bytes),
            "host_available_bytes": self.host_available_bytes,
            "launcher": self.launcher, "launched_by": self.launched_by,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> HandedDecision:
        if d.get("version") != FORMAT_VERSION:
            raise ValueError(f"decision format {d.get('version')!r}, not {FORMAT_VERSION}")
        gbs = d.get("global_batch_size")
        return cls(
            framework=str(d["framework"]), chosen=str(d["chosen"]),
            results={str(k): ProbeResult.from_dict(v) for k, v in dict(d["results"]).items()},
            run_dir=str(d["run_dir"]), attempt=int(d["attempt"]), proven=bool(d["proven"]),
            from_cache=bool(d["from_cache"]), notes=tuple(str(n) for n in d.get("notes", ())),
            global_batch_size=None if gbs is None else int(gbs),
            label=str(d.get("label", "")), processes=int(d.get("processes", 1)),
            nodes=int(d.get("nodes", 1)),
            node_trace=tuple(str(n) for n in d.get("node_trace", ())),
            reference_replicas=int(d.get("reference_replicas", 1)),
            sharding=None if d.get("sharding") is None else str(d["sharding"]),
            offload=None if d.get("offload") is None else str(d["offload"]),
            flags=tuple(str(f) for f in d.get("flags", ())),
            devices=tuple(int(x) for x in d.get("devices", ())),
            visible_devices=str(d.get("visible_devices", "")),
            free_bytes=tuple(None if b is None else int(b) for b in d.get("free_bytes", ())),
            host_available_bytes=None if d.get("host_available_bytes") is None
            else int(d["host_available_bytes"]),
            launcher=str(d.get("launcher", "")), launched_by=str(d.get("launched_by", "")),
        )

    def planned_memory(self, facts: Facts) -> Facts:
        """``facts`` with the free memory this decision was planned against (the GPUs by this
        worker's ordinal: read `renumbered` first when bound)."""
        if not self.free_bytes and self.host_available_bytes is None:
            return facts
        gpus = tuple(replace(g, memory_free_bytes=self.free_bytes[g.index])
                     if 0 <= g.index < len(self.free_bytes) else g for g in facts.gpus)
        host = facts.host if self.host_available_bytes is None else replace(
            facts.host, memory_available_bytes=self.host_available_bytes)
        return replace(facts, gpus=gpus, host=host)

    def worker_env(self) -> dict[str, str]:
        """What a worker's environment gets before the script runs: CUDA_VISIBLE_DEVICES naming
        the GPUs the decision is bound to (nothing when it is not bound)."""
        return {VISIBLE_VAR: self.visible_devices} if self.devices else {}

    def renumbered(self) -> HandedDecision:
        """The decision in a bound worker's numbering: the GPUs it is bound to are its CUDA
        ordinals 0..k-1, in order, so the chosen key and the probe results' keys name those.
        Results about other GPUs are left out (the worker cannot see them)."""
        if not self.devices:
            return self
        chosen = renumber_key(self.chosen, self.devices)
        if chosen is None:
            raise ValueError(f"the decision {self.chosen} is not over the GPUs it is bound to "
                             f"({','.join(map(str, self.devices))})")
        results = {}
        for key, result in self.results.items():
            mine = renumber_key(key, self.devices)
            if mine is not None:
                results[mine] = replace(result, candidate=mine)
        free = tuple(self.free_bytes[d] for d in self.devices if d < len(self.free_bytes))
        return replace(self, chosen=chosen, results=results,
                       free_bytes=free if len(free) == len(self.devices) else ())


#: The variable a bound decision's workers get (CUDA's own).
VISIBLE_VAR = "CUDA_VISIBLE_DEVICES"


def renumber_key(key: str, devices: tuple[int, ...]) -> str | None:
    """A candidate key (``framework:backend:devices[:env]``) with its GPUs renumbered to their
    positions in ``devices``; None when it names a GPU outside them. A key on the CPU is kept."""
    parsed = CandidateKey.read(key)
    if parsed is None:
        return key
    mine = parsed.renumbered(devices)
    return None if mine is None else mine.format()


def binding(candidate: Candidate, facts: Facts, env: Mapping[str, str]) -> tuple[
        tuple[int, ...], str]:
    """The GPUs the workers of a PyTorch decision are bound to, and CUDA_VISIBLE_DEVICES for
    them: only a decision over GPUs that are not the first ones (a worker plans on the first
    ``N`` GPUs of its launch, so FSDP over GPUs 1 and 3 must be shown to it as its GPUs 0 and
    1). ``env``: the supervisor's environment (the user's CUDA_VISIBLE_DEVICES, if set)."""
    devices = tuple(candidate.devices)
    if (candidate.framework != "torch" or not devices or candidate.backend == "cpu"
            or devices == tuple(range(len(devices)))):
        return (), ""
    gpus = [(g.index, g.uuid, g.physical_index if g.physical_index >= 0 else g.index)
            for g in facts.gpus]
    return devices, bound_devices_value(devices, gpus, env.get(VISIBLE_VAR))


def bound_devices_value(devices: tuple[int, ...], gpus: Sequence[tuple[int, str, int]],
                        user_value: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for workers bound to the CUDA ordinals ``devices``. ``gpus``: each
    visible GPU's (ordinal, UUID, NVML index). Without the user's own value, the GPUs' UUIDs
    (their NVML indices where a UUID is unknown); with it, the entries of the user's list at
    those ordinals (CUDA enumerates the listed devices in order, up to the first invalid
    entry), so the workers' GPUs stay within what the user allowed, named as the user named
    them."""
    if user_value is not None:
        entries = [e.strip() for e in user_value.split(",")]
        return ",".join(entries[d] for d in devices)
    by_ordinal = {ordinal: (uuid, nvml) for ordinal, uuid, nvml in gpus}
    return ",".join(by_ordinal[d][0] or str(by_ordinal[d][1]) for d in devices)


def write_decision(path: str | Path, decision: HandedDecision) -> None:
    """Atomically (temp file + rename in the same directory). A full or read-only filesystem
    is a NoSpaceError naming the file (the previous decision, if any, is left whole)."""
    files.write_json_atomic(path, decision.to_dict(), indent=1, sort_keys=True, durable=False,
                            what="the decision handed to the workers")


def load_decision(env: Mapping[str, str], state: WorkerState | None = None) -> HandedDecision | None:
    """The handed decision when this process is a worker of ``resilient-strategy run``."""
    return (state or WORKER).load_decision(env)


def bound_env(env: Mapping[str, str], state: WorkerState | None = None) -> dict[str, str]:
    """In a worker, before the script runs (before CUDA starts): the variables of the GPUs its
    decision is bound to (`HandedDecision.worker_env`). A decision that cannot be read binds
    nothing here: ``resilient_strategy()`` in the script says why it cannot be read."""
    try:
        decision = load_decision(env, state)
    except ResilientStrategyError:
        return {}
    return {} if decision is None else decision.worker_env()


def write_pid(run_dir: str | Path | RunDir, local_rank: int, rank: int) -> None:
    """The worker's process id and ranks, in its run directory (``rank<N>.pid``), for whoever
    must find "the process of rank N" from outside (a warm-started worker's
    ``/proc/<pid>/environ`` shows the fork server's environment, not its RANK). Best effort;
    never raises."""
    with contextlib.suppress(OSError, NoSpaceError, ValueError):
        files.write_json_atomic(RunDir.of(run_dir).pid(local_rank),
                                {"pid": os.getpid(), "rank": rank, "local_rank": local_rank},
                                durable=False, what="the worker's pid file")


CHECKPOINT_NOTE = "checkpoint.json"


def note_checkpoint(step: int, path: str | Path, state: WorkerState | None = None) -> None:
    """Under the supervisor: say where the last checkpoint is (for its relaunch line)."""
    loaded = (state or WORKER).loaded
    if not loaded:
        return
    decision = next(iter(loaded.values()))
    with contextlib.suppress(OSError, NoSpaceError):
        files.write_json_atomic(RunDir.of(decision.run_dir).checkpoint_note,
                                {"step": step, "path": str(path)}, durable=False,
                                what="the checkpoint note")


def restored_step(run_dir: str | Path | RunDir) -> int | None:
    """The checkpoint step a rank of this attempt restored (`TrainingReporter.restored`: the
    library's restore paths and ``sel.resumed_from``), None when none did: a checkpoint noted
    by an earlier attempt is no resume until the script loads it. Bounded, no FIFO, no
    symlink; an unreadable note is none."""
    note = RunDir.of(run_dir).restore_note
    try:
        data = parse_json(files.read_bytes(note, max_bytes=files.MAX_REPORT_BYTES), str(note),
                          allow_nan=True)
        step = int(data["step"])
    except (OSError, ValueError, KeyError, TypeError, ResilientStrategyError):
        return None
    return step if step > 0 else None


#: At most this many exceptions of a chain (``__cause__`` / ``__context__``) are recorded, and
#: at most this many frames of each (the innermost: where it was raised).
MAX_CHAIN = 8
MAX_FRAMES = 40


def _library_dirs() -> tuple[str, ...]:
    """Where installed code lives (the standard library, site-packages): a frame there is not
    the script's."""
    import sysconfig

    paths = sysconfig.get_paths()
    return tuple(sorted({os.path.join(paths[k], "") for k in ("stdlib", "platstdlib", "purelib",
                                                               "platlib") if k in paths}))


def _frames(tb: TracebackType | None) -> list[dict[str, Any]]:
    """The frames an exception was raised through, outermost first: module, file, function,
    line, whether the built-in table counts the module as the distributed runtime's, and
    whether it is installed code (the standard library, site-packages, this package) rather
    than the script's."""
    blame = builtin_signatures().blame
    libraries = _library_dirs()
    frames: list[dict[str, Any]] = []
    while tb is not None:
        f = tb.tb_frame
        module = f.f_globals.get("__name__")
        module = module if isinstance(module, str) else ""
        frames.append({"module": module, "file": f.f_code.co_filename,
                       "function": f.f_code.co_name, "line": tb.tb_lineno,
                       "distributed": blame.distributed(module),
                       "library": (f.f_code.co_filename.startswith((*libraries, "<frozen "))
                                   or module.split(".")[0] == "resilient_strategy")})
        tb = tb.tb_next
    return frames[-MAX_FRAMES:]


def _message(exc: BaseException, limit: int) -> str:
    try:
        return str(exc)[-limit:]
    except Exception:  # a __str__ that raises: the type is still known
        return ""


def exception_chain(exc: BaseException) -> list[dict[str, Any]]:
    """The exception then what caused it (``__cause__``, else ``__context__`` unless
    suppressed), each with its class's MRO names, its message and its frames (`_frames`), and
    an `OSError`'s ``errno``."""
    chain: list[dict[str, Any]] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(chain) < MAX_CHAIN:
        seen.add(id(e))
        chain.append({"types": [f"{t.__module__}.{t.__qualname__}" for t in type(e).__mro__],
                      "message": _message(e, 2000), "frames": _frames(e.__traceback__),
                      # an OSError's number: ENOSPC is the disk's, whatever the message says
                      **({"errno": e.errno} if isinstance(e, OSError)
                         and isinstance(e.errno, int) else {})})
        e = e.__cause__ if e.__cause__ is not None else (
            None if e.__suppress_context__ else e.__context__)
    return chain


def write_error(run_dir: str | Path, local_rank: int, exc: BaseException,
                reporter: TrainingReporter | None, pg_error: str | None = None) -> None:
    """The worker's last word: the exception's type names (its MRO) and message, its class
    chain with the frames each was raised through (`exception_chain`), and where the rank
    was (its step, its phase, whether inside the marked collective region of a step), and the
    process group's own error state when its backend reports one (``pg_error``). Best effort;
    never raises."""
    record = {
        "rank": reporter.rank if reporter else local_rank,
        "at": time.time(),
        "types": [f"{t.__module__}.{t.__qualname__}" for t in type(exc).__mro__],
        "message": _message(exc, 4000),
        "step": reporter.step if reporter else None,
        "phase": reporter.phase_name if reporter else None,
        "in_collective": bool(reporter and reporter.phase_name == COLLECTIVE),
        "pg_error": pg_error,
    }
    with contextlib.suppress(Exception):  # the chain is extra: the record goes without it
        record["chain"] = exception_chain(exc)
    with contextlib.suppress(OSError, NoSpaceError, TypeError, ValueError):
        files.write_json_atomic(RunDir.of(run_dir).error(local_rank), record, durable=False,
                                what="the rank's error record")


@dataclass
class TrainingReporter:
    """One rank's progress reports from the Selection's training calls, through the shared
    progress protocol (`resilient_strategy.records.progress`): the gradient all-reduce of optimizer
    step ``k`` is collective ``k`` (entered before the backward of the last micro-step, left
    after it; its "collective_done k" also marks the step, so the watcher's count of
    collectives never lags a rank that went on), ``step(k)`` when one process steps alone,
    communicator setup around
    ``init_process_group``. ``step`` counts optimizer steps across relaunches (a restored
    checkpoint sets it). It also fires the rehearsed fault."""

    writer: ProgressWriter
    rank: int
    backend: str
    collective: bool  # the backward of a last micro-step all-reduces (world size > 1)
    fault: TrainFault | None = None
    attempt: int = 0  # the launch attempt (a rehearsed fault may fire in the first ones only)
    step: int = 0
    phase_name: str = STARTED
    #: Where this rank's phase marks go (`phases`; None: not marked).
    phases: str | None = None
    #: Where a restore is noted for the supervisor (`RunDir.restore_note`; None: not noted).
    restore_note: str | None = None
    #: Follows each gradient all-reduce to its completion on the device (NCCL, where a
    #: collective returns when enqueued; None: leaving it is completing it). Set once, by the
    #: Selection when the process group is up.
    device: DevicePoller | None = field(default=None, repr=False)
    _fault_armed: bool = field(default=False, repr=False)
    _stepped_once: bool = field(default=False, repr=False)
    _last_step_at: float | None = field(default=None, repr=False)
    _stall_base: float = field(default=0.0, repr=False)
    _stall_noted: float = field(default=0.0, repr=False)

    def __post_init__(self) -> None:
        self._fault_armed = self.fault is not None and self.fault.applies(
            self.rank, self.backend, self.attempt)
        self._mark(phases.REPORTING)

    def _mark(self, phase: str) -> None:
        if self.phases is not None:
            phases.mark(self.phases, phase)

    @property
    def has_stepped(self) -> bool:
        """Whether this process took an optimizer step (a restore comes before)."""
        return self._stepped_once

    def restored(self, step: int) -> None:
        """The script restored a checkpoint of ``step`` optimizer steps (before this process's
        first step; later, or of no step, it is no resume and is ignored): the count goes on
        from it, and the restore is noted for the supervisor (its only proof of a resume)."""
        if self._stepped_once or step <= 0:
            return
        self._mark(phases.RESTORED)
        if self.restore_note is not None:
            with contextlib.suppress(OSError, NoSpaceError, ValueError):
                files.write_json_atomic(self.restore_note, {"step": step, "rank": self.rank},
                                        durable=False, what="the restore note")
        self.step = step
        self.writer.step(step)
        self.writer.device_done(step)  # the restored steps are complete (no-op off the device)
        self.phase_name = STEP_DONE

    def backward_begin(self, last_micro_step: bool) -> None:
        if not last_micro_step:
            return
        k = self.step + 1
        if self.collective:
            self.writer.enter(k)
            self.phase_name = COLLECTIVE
        if self._fault_armed and self.fault is not None and k == self.fault.step:
            if not self.collective:
                self.writer.enter(k)
                self.phase_name = COLLECTIVE
            self.fault.act()

    def backward_end(self, last_micro_step: bool) -> None:
        if last_micro_step and self.collective:
            self.writer.leave(self.step + 1)
            self.phase_name = COLLECTIVE_DONE
            if self.device is not None:
                self.device.record(self.step + 1)

    def checkpoint_stalled(self, total_s: float) -> None:
        """The checkpoint saves' stall so far in this process (``total_s``, cumulative; call it
        at each optimizer step, before `stepped`): what the saves added after the first step's
        mark is noted as `phases.CHECKPOINT_STALL` when it grew (at a save, not every step);
        the saves before that mark are start-up."""
        if not self._stepped_once:
            self._stall_base = total_s
            return
        stall = total_s - self._stall_base
        if stall > self._stall_noted:
            self._stall_noted = stall
            if self.phases is not None:
                phases.note(self.phases, phases.CHECKPOINT_STALL, stall)

    def stepped(self, stepped: bool) -> None:
        if not stepped:
            return
        self.step += 1
        self._last_step_at = time.time()  # marked once, when the script finishes (`done`)
        if not self._stepped_once:  # a mark per launch, not a lookup per step
            self._stepped_once = True
            self._mark(phases.FIRST_STEP)
        if not self.collective:  # with replicas, "collective_done k" already says it
            self.writer.step(self.step)
            self.phase_name = STEP_DONE

    def setup_begin(self) -> None:
        self.writer.phase(COMM_SETUP)
        self.phase_name = COMM_SETUP

    def setup_end(self) -> None:
        self.writer.phase(COMM_READY)
        self.phase_name = COMM_READY
        self._mark(phases.COMM_READY)

    def done(self) -> None:
        self.writer.phase(FINISHED, self.step)
        self.phase_name = FINISHED
        if self._last_step_at is not None and self.phases is not None:
            phases.mark(self.phases, phases.LAST_STEP, self._last_step_at)


class WorkerState:
    """What one worker process of ``resilient-strategy run`` holds: the decisions it loaded (by
    path) and its one reporter (a second ``resilient_strategy()`` call in the process reuses
    both). The public functions use the default instance, `WORKER`; a test makes its own."""

    def __init__(self) -> None:
        self.loaded: dict[str, HandedDecision] = {}
        self.reporters: list[TrainingReporter] = []

    def load_decision(self, env: Mapping[str, str]) -> HandedDecision | None:
        path = env.get(DECISION_VAR)
        if not path:
            return None
        if path not in self.loaded:
            try:  # bounded, and only a regular file: /dev/zero or a FIFO is refused, not read
                data = read_user_file(Path(path), MAX_DECISION_BYTES)
                self.loaded[path] = HandedDecision.from_dict(parse_json(data, path, allow_nan=True))
            except (OSError, ValueError, KeyError, TypeError, ResilientStrategyError) as exc:
                raise InvalidOptionError(
                    f"{DECISION_VAR}={path[:200]!r}: cannot read the decision handed down by "
                    f"`resilient-strategy run`: {exc}", DECISION_VAR) from None
        return self.loaded[path]

    def reporter_for(self, decision: HandedDecision, rank: int, local_rank: int, backend: str,
                     replicas: int, env: Mapping[str, str]) -> TrainingReporter:
        if not self.reporters:
            self.reporters.append(TrainingReporter(
                ProgressWriter(str(RunDir.of(decision.run_dir).progress(local_rank))), rank=rank,
                backend=backend, collective=replicas > 1, fault=fault_from(env),
                attempt=decision.attempt,
                phases=str(RunDir.of(decision.run_dir).phases(local_rank)),
                restore_note=str(RunDir.of(decision.run_dir).restore_note),
            ))
        return self.reporters[0]

    def current_reporter(self) -> TrainingReporter | None:
        return self.reporters[0] if self.reporters else None


#: The state of this process (the public functions' default).
WORKER = PROCESS.hold("records.handoff.worker", WorkerState,
                      "this worker's handed decision, loaded once")


def reporter_for(decision: HandedDecision, rank: int, local_rank: int, backend: str, replicas: int,
                 env: Mapping[str, str], state: WorkerState | None = None) -> TrainingReporter:
    """This process's reporter (one per process: a second resilient_strategy() call reuses it).
    Files are named by local rank: each node's supervisor watches its own workers."""
    return (state or WORKER).reporter_for(decision, rank, local_rank, backend, replicas, env)


def current_reporter(state: WorkerState | None = None) -> TrainingReporter | None:
    return (state or WORKER).current_reporter()
