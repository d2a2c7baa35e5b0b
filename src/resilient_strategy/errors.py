"""Typed errors. Every error says what happened and what the user should do."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


class ResilientStrategyError(Exception):
    """Base class of every error this library raises on purpose."""


class InvalidVisibleDevicesError(ResilientStrategyError):
    """``CUDA_VISIBLE_DEVICES`` (or the ``devices=`` argument) names GPUs that do not exist."""

    def __init__(self, value: str, problem: str) -> None:
        self.value = value
        self.problem = problem
        super().__init__(
            f"CUDA_VISIBLE_DEVICES={value!r}: {problem}. Set it to GPU indices or UUIDs that "
            "`nvidia-smi -L` lists, or unset it to use every GPU."
        )


class FrameworkInitializedError(ResilientStrategyError):
    """A framework initialized the GPUs before the selection could set the visible devices."""

    def __init__(self, framework: str, imported_at: str | None, wanted: str) -> None:
        self.framework = framework
        self.imported_at = imported_at
        self.wanted = wanted
        early = imported_at is not None and not _is_site(imported_at)
        if early:  # imported before this package, so no file:line was recorded
            where = " (it was imported before resilient_strategy, so its first import is unknown)"
            fix = (
                "Put `import resilient_strategy` first in your entry script so that a later "
                f"error can name the line that imports {framework}; then move that import (or "
                f"the first {framework} call that touches a GPU) below resilient_strategy()"
            )
        else:
            where = f" (first imported at {imported_at})" if imported_at else ""
            fix = (
                f"Move that import (or the first {framework} call that touches a GPU) below the "
                "call to resilient_strategy(), or import it lazily inside the function that uses it"
            )
        super().__init__(
            f"{framework} already initialized the GPUs{where}, so CUDA_VISIBLE_DEVICES={wanted!r} "
            f"can no longer take effect: CUDA reads it once per process. {fix}."
        )


def _is_site(text: str) -> bool:
    """Whether ``text`` looks like ``file:line``."""
    return text.rpartition(":")[2].isdigit()


class InvalidOptionError(ResilientStrategyError, ValueError):
    """An argument to resilient_strategy() is out of range or inconsistent.

    ``option`` names where the bad value came from: the argument (``"timeout"``) or the
    environment variable (``"RESILIENT_STRATEGY_TIMEOUT"``); None where no single one is to blame.
    ``suggestion``: the known value closest to a misspelt one (``"torch"`` for ``"torh"``),
    which the message offers ("did you mean"); None where none is close.
    """

    def __init__(self, message: str, option: str | None = None,
                 suggestion: str | None = None) -> None:
        self.option = option
        self.suggestion = suggestion
        super().__init__(message)


class InvalidRuleError(ResilientStrategyError, ValueError):
    """A known-issue rule is malformed."""

    def __init__(self, rule_id: str, problem: str, source: str = "") -> None:
        self.rule_id = rule_id
        self.problem = problem
        where = f" in {source}" if source else ""
        if rule_id == "?":  # the file itself, before any rule could be named
            super().__init__(f"rules file {source}: {problem}" if source else problem)
        else:
            super().__init__(f"rule {rule_id!r}{where}: {problem}")


@dataclass(frozen=True)
class FailureCause:
    """Why one candidate is out: ``status`` is the probe's (``"error"``, ``"timeout"``) or
    ``"ruled_out"`` (by a rule or the batch arithmetic); ``cause`` the probe's cause
    (``"nccl_error"``, ``"shared_memory"``, ...), the rule id, or ``"global_batch_size"``;
    ``detail`` the words."""

    candidate: str  # its label
    key: str
    status: str
    cause: str
    detail: str

    def __str__(self) -> str:
        return f"{self.candidate}: {self.detail}"


class NoWorkingStrategyError(ResilientStrategyError):
    """Every candidate was ruled out or failed its probe; ``causes`` says why, one each."""

    def __init__(self, framework: str, causes: Sequence[FailureCause]) -> None:
        self.framework = framework
        self.causes = tuple(causes)
        lines = "\n  - ".join(map(str, self.causes)) if self.causes else "(no candidates)"
        super().__init__(
            f"no strategy works for {framework} on this machine:\n  - {lines}\n"
            "Run `python -m resilient_strategy doctor` for the full trace."
        )


@dataclass(frozen=True)
class MemoryShortfall:
    """One row of the memory table: what a candidate needs per device against its devices'
    free memory (the smallest; ``free_bytes`` None: unknown), sharded over ``shards`` devices
    (1: replicated)."""

    candidate: str  # its label
    key: str
    need_bytes: int
    free_bytes: int | None
    usable_bytes: int | None
    shards: int
    where: str

    @property
    def fits(self) -> bool | None:
        return None if self.usable_bytes is None else self.need_bytes <= self.usable_bytes

    def __str__(self) -> str:
        free = "unknown" if self.free_bytes is None else f"{self.free_bytes / 2**30:.3g} GiB"
        usable = "" if self.usable_bytes is None else f" ({self.usable_bytes / 2**30:.3g} usable)"
        return (f"{self.candidate}: needs {self.need_bytes / 2**30:.3g} GiB per device; "
                f"{self.where} has {free} free{usable}")


class ModelDoesNotFitError(NoWorkingStrategyError):
    """No candidate that fits the model was left: ``table`` says what each candidate needs per
    device and what its devices have free (offloaded candidates: their GPUs' row and the
    host's); ``offload_would_fit``: offloading the state to host memory would fit, but
    ``offload="auto"`` was not passed."""

    def __init__(self, framework: str, causes: Sequence[FailureCause],
                 table: Sequence[MemoryShortfall], offload_would_fit: bool = False) -> None:
        super().__init__(framework, causes)
        self.table = tuple(table)
        self.offload_would_fit = offload_would_fit
        rows = "\n  ".join(map(str, self.table))
        advice = ("Offloading the model's state to host memory would fit: pass offload='auto' "
                  "to allow it (slower: see its estimated cost in the trace), or shard"
                  if offload_would_fit else "Shard")
        self.args = (f"the model does not fit on any strategy left for {framework} here:\n  "
                     f"{rows}\n{advice} it over more GPUs (sharding='full', more processes), "
                     "free GPU memory, or lower optimizer_state_factor (a lighter optimizer).",)


class FrameworkNotInstalledError(ResilientStrategyError):
    """The requested framework is not installed."""

    def __init__(self, framework: str | None) -> None:
        self.framework = framework
        if framework is None:  # none was asked for, and none is installed
            super().__init__(
                "neither torch nor tensorflow is installed in this environment: install the one "
                "you train with (README, Install) and call resilient_strategy() again."
            )
            return
        super().__init__(
            f"{framework} is not installed in this environment; `pip install {framework}` "
            "or pass framework= for the one you use."
        )


class UnsafePathError(ResilientStrategyError):
    """A file or directory this library would read or write is not safely this user's own
    (owned by another user, writable by group or others, a symlink, not a regular file)."""

    def __init__(self, path: str, problem: str, fix: str) -> None:
        self.path = path
        self.problem = problem
        self.fix = fix
        super().__init__(f"{path}: {problem}; refused. {fix}")


class NoSpaceError(ResilientStrategyError):
    """A file this library must write could not be written: the disk (or the user's quota) is
    full, or the filesystem is read-only (``read_only``). Named, with the fix, instead of a
    traceback, a SIGBUS or a hang later; the file's previous version is left whole."""

    def __init__(self, path: str, what: str, *, read_only: bool = False) -> None:
        self.path = path
        self.what = what
        self.read_only = read_only
        directory = path.rpartition("/")[0] or "."
        problem = "read-only file system" if read_only else "no space left on device"
        super().__init__(
            f"{path}: {problem} for {what}; what was already written is kept. Free space in "
            f"{directory} (or make it writable), or point TMPDIR (the run's files live there) "
            "at a disk with room, and run again.")

    @classmethod
    def from_os_error(cls, exc: OSError, path: str, what: str) -> NoSpaceError | None:
        """``exc`` as a NoSpaceError when a full disk, an exhausted quota or a read-only
        filesystem caused it, else None (the caller re-raises ``exc``)."""
        import errno

        full = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
        if exc.errno in full or exc.errno == errno.EROFS:
            return cls(path, what, read_only=exc.errno == errno.EROFS)
        return None


class CheckpointError(ResilientStrategyError):
    """A checkpoint could not be loaded: damaged (truncated, not a torch file, not the layout
    this library writes). Names the file; when a previous good checkpoint existed it was loaded
    instead, so this is raised only when none could be."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(
            f"{path}: not a usable checkpoint ({problem}). Move it aside to start from the "
            "beginning, or restore a copy of it; it is never loaded as arbitrary pickled code.")


class FileFormatError(ResilientStrategyError, ValueError):
    """A file this library reads is too large, nested too deep, or not what it should hold."""

    def __init__(self, path: str, problem: str) -> None:
        self.path = path
        self.problem = problem
        super().__init__(f"{path}: {problem}")


class RanksDisagreeError(ResilientStrategyError):
    """A rank re-planned from local rank 0's probe results and reached another choice."""

    def __init__(self, rank: int, planned: str | None, chosen: str | None) -> None:
        self.rank = rank
        self.planned = planned
        self.chosen = chosen
        super().__init__(
            f"rank {rank} planned {planned or 'nothing'} but local rank 0 chose "
            f"{chosen or 'nothing'}: the ranks see different machines or options. Pass the same "
            "arguments (and environment) to resilient_strategy() on every rank."
        )


class DryRunError(ResilientStrategyError, RuntimeError):
    """A dry-run Selection was asked to build a runtime (it describes, it does not train)."""

    def __init__(self, what: str = "train") -> None:
        super().__init__(
            f"this Selection is a dry run: it cannot {what}. Call resilient_strategy() without "
            "dry_run=True to train."
        )


class CacheError(ResilientStrategyError):
    """The decision cache could not be read or written (always handled as a logged degrade)."""


class MultiNodeError(ResilientStrategyError):
    """The nodes of a multi-node job could not agree on a strategy."""


class NodeLostError(MultiNodeError):
    """A node (or the job's store) stopped answering within the deadline: every node stops.

    ``node``: the node that went silent (None: the store itself, or unknown); ``how``: "deadline"
    (no answer in time), "heartbeat" (its decider stopped beating), "store" (the store failed)
    or "dropped" (node 0 went on without it: it joined a relaunch too late).
    """

    def __init__(self, message: str, node: int | None = None, how: str = "deadline") -> None:
        super().__init__(message)
        self.node = node
        self.how = how


class StoreValueError(MultiNodeError):
    """A value read from the job's store is not what this package writes there: not JSON,
    too large or too deep, or not of its message's type and bounds (an unknown cause, a
    variable a candidate may not set). ``key``: where it was read; ``problem``: why it was
    refused. The reader logs it once and treats the key as not written yet, never as a
    verdict."""

    def __init__(self, key: str, problem: str) -> None:
        super().__init__(f"the value at {key!r} in the job's store was refused: {problem}")
        self.key = key
        self.problem = problem


class NodeMismatchError(MultiNodeError):
    """A node's facts contradict the decision: every node stops before training."""


class ExtraNotInstalledError(FrameworkNotInstalledError):
    """An optional integration's tool (Lightning, Accelerate) is not installed."""

    def __init__(self, tool: str, extra: str) -> None:
        self.framework = tool
        self.extra = extra
        ResilientStrategyError.__init__(
            self, f"{tool} is not installed in this environment; "
            f"`pip install 'resilient-strategy[{extra}]'` (or `pip install {tool}`)."
        )


class WrongFrameworkError(ResilientStrategyError, AttributeError):
    """A helper of one framework was used on a selection for the other (``sel.device`` on a
    TensorFlow selection). An AttributeError too, so ``hasattr`` keeps working."""


class GpuUnusableError(ResilientStrategyError):
    """A GPU no longer initializes or runs a kernel (after a hung probe was killed): training on
    it would hang or crash, so the decision stops."""

    def __init__(self, gpus: Sequence[tuple[int, str]], after: str = "",
                 probed: Sequence[str] = ()) -> None:
        self.gpus = tuple(gpus)  # (CUDA ordinal as the job sees it, what went wrong)
        self.probed = tuple(probed)  # the candidates probed before the check found it
        lines = "\n  - ".join(f"GPU {i}: {why}" for i, why in self.gpus)
        when = f" after {after}" if after else ""
        indices = ",".join(str(i) for i, _ in self.gpus)
        super().__init__(
            f"GPU(s) {indices} no longer work{when}:\n  - {lines}\n"
            f"They need a reset (`nvidia-smi --gpu-reset -i <index>`, with no process using "
            "them) or a reboot of the machine before anything can train on them. "
            "`nvidia-smi` shows their state."
        )


class SrunTasksError(InvalidOptionError):
    """srun started more than one ``resilient-strategy run`` on one node: each would start the
    node's processes, and they would train the job several times over. ``tasks_per_node``: how
    many srun started there; ``source``: the variable that says so."""

    def __init__(self, tasks_per_node: int, source: str) -> None:
        self.tasks_per_node = tasks_per_node
        self.source = source
        super().__init__(
            f"srun started {tasks_per_node} tasks of resilient-strategy run on this node "
            f"({source}); run starts the node's processes itself: use srun "
            "--ntasks-per-node=1 (and --nproc-per-node N for the processes per node)",
            "--ntasks-per-node")


class MissingDataFileError(ResilientStrategyError):
    """A data file the package ships is missing from the installation (a broken wheel): say
    which, and how to get a working install."""


class GlobalBatchError(ResilientStrategyError):
    """An optimizer step of an adopted loop (`Selection.adopt`) was fed another number of
    samples than the decision's global batch gives it: what was claimed (the same global batch
    on every strategy) would not hold, so training stops at the first such micro-batch.
    ``step``: the optimizer step (counted from 0 in this process); ``expected`` and ``seen``:
    this process's samples in that micro-batch (in that whole step, for a loop that accumulates
    itself: ``sel.adopt(..., accumulates=True)``)."""

    def __init__(self, step: int, expected: int, seen: int, why: str, *,
                 fix: str | None = None) -> None:
        self.step = step
        self.expected = expected
        self.seen = seen
        fed = "a micro-batch" if fix is None else "a step"
        super().__init__(
            f"optimizer step {step} was fed {fed} of {seen} sample(s) where the "
            f"decision's global batch needs {expected} on this process ({why}), so each step "
            "would not see the global batch it promises. " + (fix or (
                "Build the DataLoader with batch_size=sel.batch_size (this process's "
                "micro-batch) and pass it to sel.adopt(model, optimizer, loader).")))


class AccumulateRequiredError(ResilientStrategyError):
    """An Accelerate loop stepped its optimizer outside ``accelerator.accumulate`` (it
    accumulates by hand, ``if (step + 1) % k == 0: optimizer.step()``, or not at all) while the
    decision accumulates: Accelerate would step on every call, each step seeing 1/n of the
    global batch, so the first such step stops training. ``accumulation_steps``: the
    decision's n; ``expected`` and ``seen``: this process's samples per optimizer step that the
    decision needs and that such a step would see (None where the batch is unknown). Like
    `GlobalBatchError`, what "the same global batch" claimed would not hold."""

    def __init__(self, accumulation_steps: int, micro_batch: int | None) -> None:
        self.accumulation_steps = accumulation_steps
        self.expected = None if micro_batch is None else micro_batch * accumulation_steps
        self.seen = micro_batch
        super().__init__(
            f"optimizer.step() was called outside `with accelerator.accumulate(model):`, "
            f"but this decision accumulates {accumulation_steps} micro-batches per optimizer "
            f"step, so each step would see 1/{accumulation_steps} of the global batch: put each "
            "micro-batch's forward, accelerator.backward(loss), optimizer.step() and "
            "optimizer.zero_grad() inside `with accelerator.accumulate(model):` (drop the "
            "loop's own `% k` test)")


class LaunchFaultError(ResilientStrategyError):
    """A probe failed for the launch's reason, not its candidate's (a port held, a store that
    cannot be reached, a name that does not resolve, a library that breaks ``import torch``,
    CUDA initialised too early: ``core.knowledge.causes.LAUNCH_CAUSES``): every candidate would
    fail the same way, so the decision stops here rather than fall back to fewer devices, and
    nothing of it is cached. ``cause``: the cause's key; ``candidate``: what was probed;
    ``said``: the failing worker's line."""

    def __init__(self, cause: str, candidate: str, words: str, said: str = "") -> None:
        self.cause = cause
        self.candidate = candidate
        self.said = said
        quoted = f" (the probe of {candidate} said: {said})" if said else ""
        super().__init__(f"the launch, not a strategy, failed: {words}{quoted}. Every strategy "
                         "would fail the same way, so none was chosen: fix it and run again.")
