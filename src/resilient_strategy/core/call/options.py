"""Options: every knob of a decision, as one frozen value, validated once.

`Options` (a decision) and `RunOptions` (``resilient-strategy run``) check every
field's type and range in ``__post_init__``; each error names the argument or the environment
variable the bad value came from. `arguments` reads the arguments of
``resilient_strategy()`` and the environment into them. Adding an option touches this module,
`arguments`, the ``resilient_strategy()`` signature and the options reference page.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...errors import InvalidOptionError
from ...vocab import (
    BACKENDS,
    FRAMEWORK_ALIASES,
    FRAMEWORKS,
    MULTI_BACKENDS,
    OFFLOAD_MODES,
    PRECISIONS,
    PROBE_MODES,
    SHARDING_MODES,
)
from ..knowledge.remedies import Remedies, builtin_remedies
from ..knowledge.rules import Rule
from ..values.launcher import RunLaunch
from .fields import (
    CALL,
    DEFAULT_FAULT_WINDOW,
    DEFAULT_MEASURED_SWITCH,
    DEFAULT_OPTIMIZER_STATE_FACTOR,
    DEFAULT_PROCESS_GROUP_TIMEOUT,
    DEFAULT_TIMEOUT_S,
    DEFAULT_TTL_S,
    DEFAULT_WARM_START,
    MAX_BATCH,
    MAX_CACHE_TTL_S,
    MAX_FAULT_WINDOW,
    MAX_GRADIENT_BYTES,
    MAX_LOGICAL_CPUS,
    MAX_OPTIMIZER_STATE_FACTOR,
    MAX_PROCESS_GROUP_TIMEOUT,
    MAX_RELAUNCHES,
    MAX_SAMPLE_SECONDS,
    MAX_STALL_TIMEOUT_S,
    MAX_TIMEOUT_S,
    MAX_WORLD_SIZE,
    RUN,
    OptionField,
)

__all__ = [
    "BACKENDS", "DEFAULT_FAULT_WINDOW", "DEFAULT_MEASURED_SWITCH", "DEFAULT_OPTIMIZER_STATE_FACTOR",
    "DEFAULT_PROCESS_GROUP_TIMEOUT", "DEFAULT_TIMEOUT_S", "DEFAULT_TTL_S", "DEFAULT_WARM_START",
    "FRAMEWORKS", "FRAMEWORK_ALIASES", "MAX_BATCH", "MAX_CACHE_TTL_S", "MAX_FAULT_WINDOW",
    "MAX_GRADIENT_BYTES", "MAX_LOGICAL_CPUS", "MAX_OPTIMIZER_STATE_FACTOR",
    "MAX_PROCESS_GROUP_TIMEOUT", "MAX_RELAUNCHES", "MAX_SAMPLE_SECONDS", "MAX_STALL_TIMEOUT_S",
    "MAX_TIMEOUT_S", "MAX_WORLD_SIZE", "MULTI_BACKENDS", "PRECISIONS", "PROBE_MODES", "Launch",
    "Options", "RunOptions", "default_dir",
]

#: 1 (the default) or 0: PyTorch checkpoints written in the background, or by the step itself.
CHECKPOINT_ASYNC_VAR = "RESILIENT_STRATEGY_CHECKPOINT_ASYNC"

def default_dir(env: Mapping[str, str]) -> Path:
    """RESILIENT_STRATEGY_CACHE_DIR > $XDG_CACHE_HOME/resilient_strategy > ~/.cache/..."""
    var = CALL["cache_dir"].env
    if env.get(var):
        return Path(env[var])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "resilient_strategy"


@dataclass(frozen=True)
class Launch:
    """Where this process sits in a launcher's job (torchrun); (0, 0, 1) for plain python."""

    rank: int = 0
    """This process's rank in the job (the launcher's `RANK`; 0 for plain python)."""
    local_rank: int = 0
    """This process's rank on its node (the launcher's `LOCAL_RANK`; 0 for plain python)."""
    world_size: int = 1
    """The processes the launcher started, on every node (`WORLD_SIZE`; 1 for plain python)."""
    local_world_size: int | None = None
    """The processes on this node (`LOCAL_WORLD_SIZE`); None where the launcher does not say,
    which is read as every process being on this node."""

    @property
    def launched(self) -> bool:
        """Whether a launcher started several processes (`world_size` above 1)."""
        return self.world_size > 1

    @property
    def multi_node(self) -> bool:
        """Whether the job spans nodes: fewer processes on this node than in the job."""
        return self.local_world_size is not None and self.local_world_size < self.world_size


@dataclass(frozen=True)
class Options:
    """Every knob of one decision, validated once (in ``__post_init__``). Built by
    `options_from`; the planner reads it as its policy.

    ``rank``, ``local_rank``, ``world_size`` and ``local_world_size`` are where this process
    sits in a launcher's job (torchrun), whatever the framework (``launch`` gives them as one
    value); ``processes`` is what the planner splits over: the launcher's processes for PyTorch,
    1 for TensorFlow (one process drives every GPU).
    """

    framework: str
    global_batch_size: int | None = None
    devices: tuple[int, ...] | None = None  # subset of visible GPU ordinals
    prefer: str | None = None
    gradient_bytes: int | None = None  # model gradient size, for speed estimates
    sample_seconds: float | None = None  # measured compute seconds per sample on one device
    max_per_replica_batch: int | None = None
    world_size: int = 1  # processes started by a launcher (torchrun); 1 = plain python
    local_world_size: int | None = None  # of them on this node (None: all; < world_size: multi-node)
    rank: int = 0
    local_rank: int = 0
    user_env: tuple[str, ...] = ()  # names of variables the user set (never overridden)
    logical_cpus: int = 0  # TensorFlow test mode: N logical CPU devices stand in for GPUs
    #: TensorFlow under TF_CONFIG (tfcluster.py): the workers that train together (chief
    #: included), this task's id among them, and its task as TF_CONFIG names it ("worker:1";
    #: "" without TF_CONFIG). 1 worker: not a multi-worker job.
    tf_workers: int = 1
    tf_worker_rank: int = 0
    tf_task: str = ""
    probe: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    budget_s: float = 4 * DEFAULT_TIMEOUT_S
    process_group_timeout: float = DEFAULT_PROCESS_GROUP_TIMEOUT
    dry_run: bool = False
    cache_dir: Path | None = None  # None: no cache
    cache_ttl_s: float = DEFAULT_TTL_S
    rules: tuple[Rule, ...] = ()
    #: cause -> remedies (remedies.toml plus the user's RESILIENT_STRATEGY_REMEDIES files)
    remedies: Remedies = field(default_factory=builtin_remedies, compare=False, repr=False)
    precision: str = "auto"
    framework_reason: str = ""
    quiet: bool | None = None  # None: a progress line per probe when stderr is a terminal
    #: Probe outcomes come from a description (a simulation), not from running probes here.
    simulated: bool = False
    #: Memory planning (core/measures/memory.py): "auto" shards (FSDP2) only when a replica does not fit,
    #: "full" always shards, "none" never; the model's parameter bytes (all, trainable or not),
    #: the optimizer's state per gradient byte, and the largest sharding unit's parameter bytes
    #: (from model=; None: assumed).
    sharding: str = "auto"
    param_bytes: int | None = None
    optimizer_state_factor: float = DEFAULT_OPTIMIZER_STATE_FACTOR
    shard_unit_bytes: int | None = None
    #: CPU offload of a sharded model's state (FSDP2 ``CPUOffloadPolicy``): "none" never (the
    #: default); "auto" plans it only where no candidate that keeps the state on the GPUs fits.
    offload: str = "none"
    #: PyTorch checkpoints (``sel.checkpoint``): written in the background after a host copy
    #: (True, the default) or by the step itself; ``RESILIENT_STRATEGY_CHECKPOINT_ASYNC=0``.
    checkpoint_async: bool = True

    @property
    def nodes(self) -> int:
        """Nodes of a launcher's job (1 unless WORLD_SIZE > LOCAL_WORLD_SIZE)."""
        return self.world_size // (self.local_world_size or self.world_size)

    @property
    def multi_worker(self) -> bool:
        """A TensorFlow multi-worker job (TF_CONFIG with 2+ chief/worker tasks)."""
        return self.framework == "tensorflow" and self.tf_workers > 1

    @property
    def processes(self) -> int:
        """The processes the planner splits over: the launcher's for PyTorch, else 1."""
        return self.world_size if self.framework == "torch" else 1

    @property
    def launch(self) -> Launch:
        """Where this process sits in the launcher's job."""
        return Launch(self.rank, self.local_rank, self.world_size, self.local_world_size)

    def __post_init__(self) -> None:
        for f in _CHECKED:
            f.check(getattr(self, f.field), none_ok=f.name not in _REQUIRED)
        _check_sizes(self)
        _check_test_modes(self)
        _check_memory(self)
        _check_launch(self)


#: The options `Options` checks by their fields (`fields.CALL`), and those of them that must be
#: given (None is not a value there).
_CHECKED: tuple[OptionField, ...] = tuple(CALL[n] for n in (
    "framework", "global_batch_size", "gradient_bytes", "param_bytes", "max_per_replica_batch",
    "prefer", "logical_cpus", "sharding", "offload", "optimizer_state_factor", "sample_seconds",
    "timeout", "process_group_timeout", "cache_ttl", "probe", "quiet", "precision"))
_REQUIRED = frozenset({"framework", "logical_cpus", "sharding", "offload",
                       "optimizer_state_factor", "probe", "precision"})


def _check_sizes(o: Options) -> None:
    """The sizes that are no option of the user's (the largest sharding unit, the launcher's
    counts) and the devices asked for."""
    for name, top in (("shard_unit_bytes", MAX_GRADIENT_BYTES), ("world_size", MAX_WORLD_SIZE),
                      ("local_world_size", MAX_WORLD_SIZE)):
        value = getattr(o, name)
        if value is not None and (
            not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= top
        ):
            raise InvalidOptionError(
                f"{name} must be a positive integer (at most {top}), not {value!r}", name)
    if o.devices is not None and (
        not o.devices or len(set(o.devices)) != len(o.devices)
        or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in o.devices)
    ):
        raise InvalidOptionError(f"devices must be distinct GPU indices, not {o.devices!r}",
                                 "devices")
    if not isinstance(o.checkpoint_async, bool):
        raise InvalidOptionError(
            f"checkpoint_async must be True or False, not {o.checkpoint_async!r}",
            CHECKPOINT_ASYNC_VAR)


def _check_test_modes(o: Options) -> None:
    """TensorFlow's logical CPUs and its ``TF_CONFIG`` workers: TensorFlow's, and apart."""
    if o.logical_cpus and o.framework != "tensorflow":
        raise InvalidOptionError("logical_cpus is a TensorFlow test mode: a positive count",
                                 "logical_cpus")
    for name, value, low, top in (("tf_workers", o.tf_workers, 1, MAX_WORLD_SIZE),
                                  ("tf_worker_rank", o.tf_worker_rank, 0, MAX_WORLD_SIZE - 1)):
        if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= top:
            raise InvalidOptionError(f"{name} must be an integer from {low} to {top}, not "
                                     f"{value!r}", "TF_CONFIG")
    if o.tf_worker_rank >= o.tf_workers:
        raise InvalidOptionError(f"TF_CONFIG: worker {o.tf_worker_rank} of "
                                 f"{o.tf_workers}", "TF_CONFIG")
    if o.tf_workers > 1 and o.framework != "tensorflow":
        raise InvalidOptionError("TF_CONFIG workers are TensorFlow's; torch jobs use "
                                 "torchrun", "TF_CONFIG")
    if o.tf_workers > 1 and o.logical_cpus:
        raise InvalidOptionError(
            "logical_cpus is a single-process test mode; under a multi-worker TF_CONFIG each "
            "CPU worker is one replica of MultiWorkerMirroredStrategy: leave logical_cpus 0",
            "logical_cpus")


def _check_memory(o: Options) -> None:
    """Sharding and offload: PyTorch's FSDP2, and offload only of a sharded model."""
    if o.sharding == "full" and o.framework != "torch":
        raise InvalidOptionError(
            "sharding='full' is PyTorch's FSDP2; TensorFlow shards through keras.distribution "
            "(out of scope here, see docs/how-to/large-models.md)", "sharding")
    if o.offload != "none" and o.framework != "torch":
        raise InvalidOptionError(
            "offload is PyTorch's FSDP2 CPUOffloadPolicy; TensorFlow has no such option here",
            "offload")
    if o.offload != "none" and o.sharding == "none":
        raise InvalidOptionError(
            "offload='auto' offloads a sharded (FSDP2) model's state, and sharding='none' "
            "never shards: drop one of them", "offload")


def _check_launch(o: Options) -> None:
    """The launcher's ranks within its sizes, and the global batch split over its processes."""
    if o.local_world_size is not None and (
        o.local_world_size > o.world_size or o.world_size % o.local_world_size
    ):
        raise InvalidOptionError(
            f"LOCAL_WORLD_SIZE={o.local_world_size} does not divide WORLD_SIZE="
            f"{o.world_size}: every node must run the same number of processes",
            "LOCAL_WORLD_SIZE",
        )
    for name, value in (("RANK", o.rank), ("LOCAL_RANK", o.local_rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidOptionError(f"{name}={value!r}: expected an integer", name)
    if not 0 <= o.rank < o.world_size:
        raise InvalidOptionError(
            f"RANK={o.rank}: expected 0 to WORLD_SIZE-1 ({o.world_size - 1})", "RANK")
    local = o.local_world_size or o.world_size
    if not 0 <= o.local_rank < local:
        raise InvalidOptionError(
            f"LOCAL_RANK={o.local_rank}: expected 0 to {local - 1}", "LOCAL_RANK")
    g, w = o.global_batch_size, o.processes
    if g is not None and w > 1 and g % w:
        raise InvalidOptionError(
            f"global_batch_size={g} cannot be split exactly over the {w} processes the "
            f"launcher started; use a multiple of {w}", "global_batch_size"
        )


# ----- `resilient-strategy run` -------------------------------------------------------------
@dataclass(frozen=True)
class RunOptions:
    """What ``resilient-strategy run`` was asked (the supervisor's knobs), validated once.
    torchrun's own node options travel as parsed by torchrun (``torchrun``)."""

    script: str
    script_args: tuple[str, ...] = ()
    framework: str | None = None
    nproc: int | None = None  # None: "auto" (one per visible GPU, else 1)
    max_relaunches: int | None = None  # None: no count (the policy's bounds still hold)
    stall_timeout_s: float | None = None  # None: max(15 s, 5 x the p99 step time)
    #: How long a rank busy in its own code may keep the others waiting (None: run/watch's
    #: DEFAULT_BUSY_S).
    busy_timeout_s: float | None = None
    global_batch_size: int | None = None  # for ranking (the script's own value trains)
    gradient_bytes: int | None = None
    probe_timeout_s: float | None = None
    logical_cpus: int = 0
    torchrun: Any = field(default=None, compare=False)  # torchrun's parsed arguments
    #: A step-down never lands below this fraction of the estimated throughput of what failed.
    min_throughput: float = 0.25
    allow_cpu: bool = False  # a GPU job may step down to the CPU
    max_attempts_without_progress: int = 3  # the crash-loop bound
    #: The fault-rate window, in optimizer steps: a second fault on a strategy within it steps
    #: down; a communication error this many steps after the last fault is retried first.
    fault_window: int = DEFAULT_FAULT_WINDOW
    evidence_dir: str = "resilient-strategy-evidence"  # per-rank tracebacks of each fault
    #: Memory planning, as resilient_strategy() takes it; None: not given (planned as "auto",
    #: and the script's own value is then the one that must agree: see handoff.HandedDecision).
    sharding: str | None = None
    param_bytes: int | None = None
    optimizer_state_factor: float | None = None
    #: CPU offload (FSDP2 CPUOffloadPolicy), as resilient_strategy(offload=) takes it; None: not
    #: given (planned as "none").
    offload: str | None = None
    #: Start a torch job's workers warm: forked per rank and per attempt from one server that
    #: imported torch once (``--warm-start``, RESILIENT_STRATEGY_WARM_START; run/warm.py).
    warm_start: bool = DEFAULT_WARM_START
    #: Act on a measured "another candidate is clearly faster": stop at a checkpoint, try it,
    #: keep the faster (``--measured-switch``, RESILIENT_STRATEGY_MEASURED_SWITCH; off: told only).
    measured_switch: bool = DEFAULT_MEASURED_SWITCH
    #: Who started run and the node options read from it (`core.values.launcher.RunLaunch`:
    #: srun's nodes, node rank, rendezvous, GPUs per node where the user gave none).
    run_launch: RunLaunch = field(default_factory=RunLaunch, compare=False)

    @property
    def planned_sharding(self) -> str:
        return self.sharding or "auto"

    @property
    def planned_offload(self) -> str:
        return self.offload or "none"

    def __post_init__(self) -> None:
        for f in RUN.values():
            if f.kind != "onoff":  # --warm-start / --measured-switch: resolved, below
                f.check(getattr(self, f.field), none_ok=f.name not in _RUN_REQUIRED)
        if self.nproc is not None and (isinstance(self.nproc, bool) or not isinstance(
                self.nproc, int) or not 1 <= self.nproc <= MAX_WORLD_SIZE):
            raise InvalidOptionError(f"--nproc-per-node must be an integer from 1 to "
                                     f"{MAX_WORLD_SIZE}, not {self.nproc!r}", "--nproc-per-node")
        _check_memory_flags(self.sharding, self.offload, self.framework)
        for f in (RUN["warm_start"], RUN["measured_switch"]):
            value = getattr(self, f.field)
            if not isinstance(value, bool):
                raise InvalidOptionError(f"{f.flag} is on or off, not {value!r}", f.flag)
        if not self.evidence_dir or "\0" in self.evidence_dir:
            raise InvalidOptionError(f"--evidence-dir must be a path, not {self.evidence_dir!r}",
                                     "--evidence-dir")


#: run's flags that always hold a value (None is not one).
_RUN_REQUIRED = frozenset({"min_throughput", "max_attempts_without_progress", "fault_window",
                           "evidence_dir"})


def _check_memory_flags(sharding: str | None, offload: str | None, framework: str | None) -> None:
    """``--sharding`` / ``--offload`` as Options checks ``sharding=`` / ``offload=``, each error
    naming the flag."""
    if sharding is not None and sharding not in SHARDING_MODES:
        raise InvalidOptionError(f"--sharding must be one of {SHARDING_MODES}, not {sharding!r}",
                                 "--sharding")
    if offload is not None and offload not in OFFLOAD_MODES:
        raise InvalidOptionError(f"--offload must be one of {OFFLOAD_MODES}, not {offload!r}",
                                 "--offload")
    if framework == "tensorflow" and (sharding == "full" or offload == "auto"):
        flag = "--sharding" if sharding == "full" else "--offload"
        raise InvalidOptionError(f"{flag} {sharding if flag == '--sharding' else offload} is "
                                 "PyTorch's FSDP2; this script trains with TensorFlow", flag)
    if offload == "auto" and sharding == "none":
        raise InvalidOptionError("--offload auto offloads a sharded (FSDP2) model's state, and "
                                 "--sharding none never shards: drop one of them", "--offload")


#: The stall timeout's floor when it follows the step time (see supervisor.default_stall_timeout)
MIN_STALL_S = 15.0
