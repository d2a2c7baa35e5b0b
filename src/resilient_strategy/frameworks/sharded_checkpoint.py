"""Sharded checkpoints through ``torch.distributed.checkpoint`` (DCP), for FSDP2 models.

`checkpoint.Checkpointer` keeps one interface: it saves here when the model is sharded
(every rank writes its own shards, in parallel) and restores from here whenever the newest
checkpoint in its directory is a sharded one, into whatever the relaunch trains: FSDP2 over
another number of processes (DCP reshards on load), or one process with a plain module (DCP
loads without a process group then). The rest of the state (epoch, position in the epoch,
optimizer steps, GradScaler, RNG) is the same dictionary the replicated checkpoint holds, written
by rank 0 beside the shards.

Layout under the checkpoint directory::

    sharded/step-000000100/   DCP's files (.metadata, __<rank>_0.distcp) and meta.pt
    sharded/latest            the name of the last complete step directory (atomic rename)

A step is complete when its ``.metadata`` (written by DCP after every rank's shards) and
``meta.pt`` exist; ``latest`` is written after a barrier. The asynchronous save (`save_async`,
the checkpointer's default) stages the shards in host memory through torch's
``torch.distributed.checkpoint.async_save`` and writes them in the background, its collectives
on a gloo group of its own (async_save needs a CPU backend; a second thread's collectives on the
training group could interleave with the training thread's and deadlock); rank 0 publishes the
step (private modes, ``meta.pt``, ``latest``) only after DCP finished every rank's shards and
its ``.metadata``: a step killed or failed before that is never complete, and a failed one is
removed. The `KEEP` newest steps are kept,
never one newer than the step just saved.

Trust (the rules of `resilient_strategy.machine.files`, the same as the plain checkpoint's):
before anything is read, the checkpoint directory, ``sharded/`` and each step directory must be
this user's own directories, not symlinks, not writable by group or others; every file of a step
directory (and ``latest``) must be a regular file of this user's, not writable by group or
others, and is opened without following links and without blocking (a FIFO is refused), with
bounded reads. Otherwise `resilient_strategy.errors.UnsafePathError` names the path and
nothing is loaded. DCP's ``.metadata`` is a pickle, which torch reads with plain
``pickle.load``: here it is read instead by an unpickler that builds only DCP's own metadata
classes, torch's dtypes and sizes and, by name, the members of DCP's enum (how early Python
3.11 releases, 3.11.2 among them, pickle them; anything else is refused before it is built), that sets state only
on the metadata objects it made itself and builds at most half an entry per byte of the file;
then it is checked (every shard a file of the step directory, within its size; every tensor's
chunks distinct, inside the tensor, stored, at most `_CHUNKS_PER_FILE` per shard file) before
DCP sees it; the non-tensor
values (the optimizer's hyper-parameters) are read with ``torch.load(weights_only=True)``, not
DCP's ``weights_only=False``. Everything is created private: 0700 directories, 0600 files, DCP's
own files included (written under umask 077, then chmod-ed).

Damage: a step that is truncated, unreadable or malformed (or a ``latest`` naming a missing
step) is reported in one line and the next older complete step is loaded; a damaged step is set
aside as ``damaged-step-...``. torch is imported inside functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import functools
import io
import logging
import os
import pickle
import re
import shutil
import stat
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

from ..errors import CheckpointError, FileFormatError, NoSpaceError, UnsafePathError
from ..machine import files

__all__ = ["DIR_NAME", "latest", "load", "newest_is_sharded", "private_writer", "save",
           "save_async", "state_dicts", "steps"]

log = logging.getLogger("resilient_strategy")

DIR_NAME = "sharded"
LATEST = "latest"
META = "meta.pt"
METADATA = ".metadata"
KEEP = 2
_STEP = re.compile(r"step-\d{9,}")
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
#: Byte bounds: the pointer holds one step name; DCP's metadata of a large model is megabytes.
MAX_POINTER_BYTES = 256
MAX_METADATA_BYTES = 256 << 20
MAX_META_BYTES = 64 << 20
_FIX = ("Point the checkpoint at a directory of your own (mode 0700), or remove what another "
        "user or program put in it; nothing in it was loaded.")

#: What DCP's ``.metadata`` pickle may build (torch 2.13's DCP, checked): its own metadata
#: classes, the path it records, torch's sizes, dtypes, layouts and memory formats. Nothing
#: that runs code.
_METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath", "Path"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},
}
#: Python 3.13 pickles pathlib's classes as ``pathlib._local``'s: read as pathlib's own.
_PATHLIB_MODULES = ("pathlib", "pathlib._local")
#: The entry bound (`_entry_budget`): DCP's files spend 4.1 to 9.6 bytes an entry (measured,
#: torch 2.13, 1 to 2000 chunks a tensor, 1 to 300 tensors); twice that many pass.
_BYTES_PER_ENTRY = 2
_MIN_METADATA_ENTRIES = 100_000
#: Chunks of one tensor, at most, per shard file of its step: a rank writes one file (DCP's
#: FileSystemWriter, one thread) and one chunk of each tensor under FSDP2, a few under 2-D
#: sharding.
_CHUNKS_PER_FILE = 16


class _TooManyEntries(pickle.UnpicklingError):
    """The metadata builds more entries than its size allows (`_entry_budget`)."""


@functools.cache
def _instance_types() -> frozenset[type]:
    """DCP's metadata classes: the only objects whose state a metadata pickle sets (BUILD)."""
    import importlib

    return frozenset(getattr(importlib.import_module(module), name)
                     for module, names in _METADATA_CLASSES.items()
                     if module.startswith("torch.distributed") for name in names
                     if dataclasses.is_dataclass(getattr(importlib.import_module(module), name)))


@functools.cache
def _field_names(cls: Any) -> frozenset[str]:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _check_dir(path: Path) -> None:
    """``path`` (under the checkpoint directory) is a directory of this user's, no symlink."""
    files.check_private_dir(path, fix=_FIX, follow_links=False)


def _root(directory: Path) -> Path | None:
    """``directory/sharded`` checked (the checkpoint directory itself is the caller's to check),
    or None when there is none."""
    root = Path(directory) / DIR_NAME
    if not os.path.lexists(root):
        return None
    _check_dir(root)
    return root


def _pointer(root: Path, report: bool) -> str | None:
    """The step name ``latest`` holds (read safely: no link, no FIFO, bounded), or None when
    absent; a malformed one is ignored (the steps on disk decide), and said when ``report``."""
    path = root / LATEST
    if not os.path.lexists(path):
        return None
    say = log.warning if report else log.debug
    try:
        raw = files.read_bytes(path, max_bytes=MAX_POINTER_BYTES)
    except (OSError, FileFormatError) as exc:
        say("resilient_strategy: %s is unreadable (%s); using the newest complete step",
                    path, exc)
        return None
    name = raw.decode("utf-8", "replace").strip()
    if not _STEP.fullmatch(name):
        say("resilient_strategy: %s names %r, not a step; using the newest complete step",
                    path, name[:40])
        return None
    if not os.path.lexists(root / name):
        say("resilient_strategy: %s names %s, which is missing; using the newest "
                    "complete step", path, name)
    return name


def steps(directory: Path, *, report: bool = False) -> list[Path]:
    """The complete step directories under ``directory`` (``.metadata`` and ``meta.pt`` both
    there), newest first; each checked for trust on the way (UnsafePathError), ``latest`` too
    (a damaged one is said in one line when ``report``: the steps on disk decide)."""
    root = _root(directory)
    if root is None:
        return []
    _pointer(root, report)
    found: list[Path] = []
    for name in sorted(os.listdir(root), reverse=True):
        if not _STEP.fullmatch(name):
            continue
        step = root / name
        _check_dir(step)
        if os.path.lexists(step / METADATA) and os.path.lexists(step / META):
            found.append(step)
    return found


def latest(directory: Path) -> Path | None:
    """The newest complete sharded checkpoint under ``directory``, or None."""
    found = steps(directory)
    return found[0] if found else None


def newest_is_sharded(directory: Path, plain: Path) -> bool:
    """Whether the newest checkpoint in ``directory`` is a sharded one (rather than ``plain``).
    The caller has checked ``directory``; ``sharded/`` and its steps are checked here."""
    newest = latest(directory)
    if newest is None:
        return False
    try:
        return os.lstat(newest / META).st_mtime >= os.lstat(plain).st_mtime
    except FileNotFoundError:
        return True


def _barrier(group: Any = None) -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def _state_dicts(model: Any, optimizer: Any) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    optimizers = [optimizer] if optimizer is not None else []
    model_sd, optim_sd = get_state_dict(model, optimizers)
    return {"model": model_sd, "optimizer": optim_sd if optimizer is not None else {}}


def state_dicts(model: Any, optimizer: Any) -> dict[str, Any]:
    """What a sharded save writes: the model's and the optimizer's state dicts (DTensors)."""
    return _state_dicts(model, optimizer)


def _new_step(directory: Path, meta: dict[str, Any], rank: int) -> tuple[Path, Path]:
    """``sharded/`` and the step directory of ``meta``'s optimizer step, created afresh and
    private by rank 0 (the caller then holds the other ranks in a barrier)."""
    root = Path(directory) / DIR_NAME
    step = root / f"step-{int(meta.get('optimizer_steps', 0)):09d}"
    if rank == 0:
        with files.writing(root, "the sharded checkpoint"):
            files.ensure_private_dir(Path(directory), fix=_FIX)  # never into another's
            files.ensure_private_dir(root, fix=_FIX)
            _check_dir(root)  # and not through a symlink
            if os.path.lexists(step):  # a save at the same step that did not finish: afresh
                _check_dir(step)
                shutil.rmtree(step)
            os.mkdir(step, 0o700)
    return root, step


def save(directory: Path, model: Any, optimizer: Any, meta: dict[str, Any], rank: int) -> Path:
    """Every rank writes its shards of the model and optimizer (a collective); rank 0 writes
    ``meta`` (the rest of the training state) and then points ``latest`` at the new step.
    Everything is created private; a full or read-only disk is a NoSpaceError naming the file,
    and the steps already written are kept."""
    import torch
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

    root, step = _new_step(directory, meta, rank)
    _barrier()
    try:
        with warnings.catch_warnings(), files.private_umask(), \
                files.writing(step, "the sharded checkpoint"):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                dcp_save(_state_dicts(model, optimizer), checkpoint_id=str(step))
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                raise _first_failure(exc) from None
        if rank == 0:
            _write_atomic(step / META, lambda fh: torch.save(meta, fh))
    except NoSpaceError:
        if rank == 0:  # the incomplete step goes (its space with it); the last one is whole
            shutil.rmtree(step, ignore_errors=True)
        raise
    _barrier()  # every rank's shards and the meta are written: now the step is complete
    if rank == 0:
        files.make_private(step)  # DCP's own files, whatever modes it chose
        _write_atomic(root / LATEST, lambda fh: fh.write(step.name.encode()))
        _prune(root, keep=step.name)
    return step


def private_writer(path: Path, *, cache: bool = False) -> Any:
    """DCP's FileSystemWriter whose files are created 0600 (``O_NOFOLLOW``), whatever the
    process's umask: the asynchronous save writes while the training thread runs, so the umask,
    which is the whole process's, is not changed around it. ``cache``: keep the staged host copy
    for the next save (pinned memory; GPUs only)."""
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

    class _PrivateFiles(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if mode != "wb":
                with super().create_stream(path, mode) as stream:
                    yield stream
                return
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _NOFOLLOW | _CLOEXEC,
                         0o600)
            with os.fdopen(fd, "wb") as stream:
                yield stream

    writer = FileSystemWriter(path, cache_staged_state_dict=cache)
    writer.fs = _PrivateFiles()
    return writer


def save_async(directory: Path, model: Any, optimizer: Any, meta: dict[str, Any], rank: int,
               *, group: Any, writer: Any) -> tuple[Path, Callable[[], None]]:
    """The asynchronous `save`: torch's ``async_save`` copies this rank's shards to host memory
    now (the staging: the step pays for it) and writes them in its own thread, its collectives on
    ``group`` (a gloo group of the checkpoint's own: never the training group, whose collectives
    the training thread issues meanwhile). Returns the step directory and ``finish``, which the
    caller runs in its background thread: it waits for the shards (every rank's: DCP's
    ``.metadata`` is written after all of them), then rank 0 makes the step private, writes
    ``meta`` and points ``latest`` at it. A step whose write failed is removed, never published;
    a full or read-only disk is a NoSpaceError naming the step. Every rank calls it (a
    collective); ``meta`` is the caller's snapshot."""
    import torch
    from torch.distributed.checkpoint.state_dict_saver import async_save

    root, step = _new_step(directory, meta, rank)
    _barrier(group)
    try:
        with warnings.catch_warnings(), files.writing(step, "the sharded checkpoint"):
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            try:
                response = async_save(_state_dicts(model, optimizer), checkpoint_id=str(step),
                                      storage_writer=writer, process_group=group)
            except BaseException as exc:  # DCP's CheckpointException is a BaseException
                raise _first_failure(exc) from None
    except BaseException:
        if rank == 0:
            shutil.rmtree(step, ignore_errors=True)
        raise
    # torch 2.13 answers an AsyncSaveResponse when the stager stages in the background
    future: Any = getattr(response, "upload_completion", response)

    def finish() -> None:
        try:
            with files.writing(step, "the sharded checkpoint"):
                try:
                    future.result()
                except BaseException as exc:
                    raise _first_failure(exc) from None
            if rank == 0:
                files.make_private(step)  # before meta.pt: a step is complete with it
                _write_atomic(step / META, lambda fh: torch.save(meta, fh))
        except BaseException:
            if rank == 0:  # the incomplete step goes (its space with it); the last one is whole
                shutil.rmtree(step, ignore_errors=True)
            raise
        if rank == 0:
            _write_atomic(root / LATEST, lambda fh: fh.write(step.name.encode()))
            _prune(root, keep=step.name)

    return step, finish


def load(directory: Path, model: Any, optimizer: Any) -> dict[str, Any] | None:
    """Load the newest good sharded checkpoint into ``model`` and ``optimizer`` (sharded or
    not, any world size) and return the rest of its state, or None when there is none. A
    damaged step is reported in one line, set aside, and the previous one is loaded; with none
    left, CheckpointError names the newest. UnsafePathError when any path is not safely this
    user's (nothing is loaded then)."""
    problems: list[tuple[Path, str]] = []
    for step in steps(directory, report=True):
        try:
            meta = _load_step(step, model, optimizer)
        except CheckpointError as exc:
            problems.append((step, exc.problem))
            continue
        for bad, problem in problems:
            _set_aside(bad, problem, step)
        return meta
    if problems:
        path, problem = problems[0]
        raise CheckpointError(str(path), problem + (
            f"; the {len(problems) - 1} older step(s) too" if len(problems) > 1
            else "; there is no previous step to fall back to"))
    return None


def _set_aside(bad: Path, problem: str, used: Path) -> None:
    aside = bad.with_name(f"damaged-{bad.name}")
    files.set_aside(bad, aside, keep_existing=True)
    log.warning("resilient_strategy: sharded checkpoint %s is damaged (%s); set aside, resuming "
                "from the previous step, %s", bad, problem, used.name)


def _load_step(step: Path, model: Any, optimizer: Any) -> dict[str, Any]:
    """One step loaded after every check; CheckpointError (naming the step) when damaged."""
    import torch
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load

    sizes = files.check_private_files(step, fix=_FIX)  # every file, before any is opened
    metadata = read_metadata(step, sizes)
    try:
        with files.open_owned(step / META) as fh:
            if os.fstat(fh.fileno()).st_size > MAX_META_BYTES:
                raise CheckpointError(str(step / META), "larger than a training state")
            meta = torch.load(fh, map_location="cpu", weights_only=True)
    except (CheckpointError, UnsafePathError):
        raise
    except Exception as exc:  # torch.load's errors of a damaged file are of many types
        raise CheckpointError(str(step / META), _problem(exc)) from None
    if not isinstance(meta, dict):
        raise CheckpointError(str(step / META), f"it holds a {type(meta).__name__}, not a dict")
    wanted = _state_dicts(model, optimizer)
    if optimizer is None:
        wanted.pop("optimizer")
    try:
        with warnings.catch_warnings():  # one process loading: what we mean, said once here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp_load(wanted, checkpoint_id=str(step), storage_reader=_reader(step, metadata),
                     planner=_planner())
    except (UnsafePathError, CheckpointError):
        raise
    except (Exception, CheckpointException) as exc:  # DCP's is a BaseException
        failure = _first_failure(exc)
        if isinstance(failure, (UnsafePathError, CheckpointError)):
            raise failure from None
        raise CheckpointError(str(step), _problem(failure)) from None
    set_state_dict(model, [optimizer] if optimizer is not None else [],
                   model_state_dict=wanted["model"],
                   optim_state_dict=wanted.get("optimizer", {}))
    return {**meta, "model": None, "optimizer": None}


def _first_failure(exc: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (``exc`` otherwise), so
    that a full disk under DCP is the OSError it was."""
    failures = getattr(exc, "failures", None)
    if type(exc).__name__ == "CheckpointException" and isinstance(failures, dict) and failures:
        first = failures[min(failures)]
        if isinstance(first, tuple) and first and isinstance(first[0], BaseException):
            exc = first[0]
    cause: BaseException | None = exc
    for _ in range(8):  # torch.save's zip writer raises a RuntimeError while the OSError is
        if isinstance(cause, OSError):  # handled: the OSError is what happened
            return cause
        cause = None if cause is None else (cause.__cause__ or cause.__context__)
    return exc


def _problem(exc: BaseException) -> str:
    """An exception in a few words on one line, never torch's advice to load arbitrary
    pickles."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if "weights_only" in first or "weights only" in first.lower() or len(first) > 200:
        first = ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _entry_budget(size: int) -> int:
    """How many entries (container items, objects made, states set) a metadata pickle of
    ``size`` bytes may build: half an entry a byte, twice what DCP's own files build, so that
    neither a 1-byte opcode making a container nor a 2-byte memo reference builds more than
    the file's size says. (What a file of references to one chunk costs DCP's planner is
    bounded by `_check_chunks`.)"""
    return _MIN_METADATA_ENTRIES + size // _BYTES_PER_ENTRY


class _MetadataUnpickler(pickle._Unpickler):
    """Builds only `_METADATA_CLASSES`, torch's dtypes and, by name, the members of an allowed
    enum; refuses every other global before it is built.

    The pure-Python unpickler (a few times slower than C's, next to DCP's own construction
    costs), so that each opcode that could reach shared state is checked: ``builtins.getattr``
    (how Python 3.11.2, Debian 12's, pickles an enum member) is a callable that returns a member of an
    allowed enum and nothing else; BUILD (``__setstate__`` or ``__dict__`` update) sets the
    state only of an instance of DCP's metadata classes that this load made, never of a class,
    an enum member or a constant shared by the process; ``APPEND``/``SETITEM``/``ADDITEMS`` add
    only to a list, dict or set; the entries built are bounded (`_entry_budget`) before any is
    built past the bound."""

    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(
        pickle._Unpickler.dispatch)  # a copy: pickle's own table is left as it is
    stack: list[Any]
    append: Callable[[Any], None]
    pop_mark: Callable[[], list[Any]]

    def __init__(self, file: io.BytesIO, budget: int) -> None:
        super().__init__(file)
        self._left = budget
        self._globals: dict[int, Any] = {}  # what find_class handed out: REDUCE's callables
        self._fresh: dict[int, Any] = {}  # instances of _instance_types() this load made

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module in ("builtins", "__builtin__") and name == "getattr":
            found: Any = self._member
        elif name in _METADATA_CLASSES.get(module, ()):
            found = super().find_class(module, name)
        elif module in _PATHLIB_MODULES and name in _METADATA_CLASSES["pathlib"]:
            found = super().find_class("pathlib", name)  # 3.13 writes pathlib._local
        elif module == "torch" and isinstance(getattr(torch, name, None),
                                              (torch.dtype, torch.layout, torch.memory_format)):
            found = getattr(torch, name)
        else:
            raise pickle.UnpicklingError(f"refers to {module}.{name}, which a checkpoint's "
                                         "metadata never holds")
        self._globals[id(found)] = found
        return found

    def _member(self, cls: Any, name: Any) -> Any:
        """``getattr(cls, name)`` only for a member of an allowed enum."""
        if not (isinstance(cls, type) and issubclass(cls, enum.Enum)
                and self._handed(cls) and isinstance(name, str)
                and name in cls.__members__):
            raise pickle.UnpicklingError("getattr of something other than a member of an "
                                         "allowed enum")
        return cls.__members__[name]

    def _handed(self, obj: object) -> bool:
        """``obj`` is a global find_class handed out (the only things REDUCE calls)."""
        return id(obj) in self._globals and self._globals[id(obj)] is obj

    def _made_here(self, obj: object) -> bool:
        return id(obj) in self._fresh and self._fresh[id(obj)] is obj

    def _spend(self, entries: int) -> None:
        self._left -= entries
        if self._left < 0:
            raise _TooManyEntries("more entries than a metadata file of its size holds")

    def _made(self, maker: Any, obj: Any) -> Any:
        if isinstance(maker, type) and type(obj) is maker and maker in _instance_types():
            self._fresh[id(obj)] = obj  # kept alive here: its id cannot be reused
        return obj

    def load_reduce(self) -> None:
        self._spend(1)
        args = self.stack.pop()
        func = self.stack[-1]
        if not self._handed(func) or type(args) is not tuple:
            raise pickle.UnpicklingError("calls something that is not an allowed global")
        self.stack[-1] = self._made(func, func(*args))

    def load_newobj(self) -> None:
        self._spend(1)
        args = self.stack.pop()
        cls = self.stack.pop()
        if not self._handed(cls) or not isinstance(cls, type) or type(args) is not tuple:
            raise pickle.UnpicklingError("makes something that is not an allowed class")
        self.append(self._made(cls, cls.__new__(cls, *args)))

    def load_newobj_ex(self) -> None:
        self._spend(1)
        kwargs = self.stack.pop()
        if kwargs:
            raise pickle.UnpicklingError("NEWOBJ_EX with keyword arguments")
        self.load_newobj()

    def load_build(self) -> None:
        self._spend(1)
        state = self.stack.pop()
        inst = self.stack[-1]
        if not self._made_here(inst):
            raise pickle.UnpicklingError("sets the state of an object this load did not make "
                                         "(a class, an enum member or a shared constant)")
        cls: Any = type(inst)
        setstate = getattr(cls, "__setstate__", None)  # object has none: a class's own
        if setstate is not None:
            setstate(inst, state)
            return
        slots = None
        if type(state) is tuple and len(state) == 2:
            state, slots = state
        for part in (state, slots):
            if part is None:
                continue
            if type(part) is not dict:
                raise pickle.UnpicklingError("a state that is not a dict")
            for key in part:
                if type(key) is not str or (key not in _field_names(cls) and hasattr(cls, key)):
                    raise pickle.UnpicklingError(f"sets {cls.__name__}.{key!s:.40}, not a field")
        if state:
            inst.__dict__.update(state)
        for key, value in (slots or {}).items():
            setattr(inst, key, value)

    def _container(self, kind: type, what: str) -> Any:
        target = self.stack[-1]
        if type(target) is not kind:
            raise pickle.UnpicklingError(f"adds items to a {type(target).__name__}, not a {what}")
        return target

    def load_append(self) -> None:
        self._spend(1)
        value = self.stack.pop()
        self._container(list, "list").append(value)

    def load_appends(self) -> None:
        items = self.pop_mark()
        self._spend(len(items) + 1)
        self._container(list, "list").extend(items)

    def load_setitem(self) -> None:
        self._spend(1)
        value = self.stack.pop()
        key = self.stack.pop()
        self._container(dict, "dict")[key] = value

    def load_setitems(self) -> None:
        items = self.pop_mark()
        self._spend(len(items) // 2 + 1)
        target = self._container(dict, "dict")
        for i in range(0, len(items) - 1, 2):
            target[items[i]] = items[i + 1]

    def load_additems(self) -> None:
        items = self.pop_mark()
        self._spend(len(items) + 1)
        self._container(set, "set").update(items)

    def _refuse(self) -> None:
        raise pickle.UnpicklingError("an opcode DCP's metadata never holds")


def _counting(base: Callable[[Any], None], weight: Callable[[Any], int]) -> Callable[[Any], None]:
    def counted(self: _MetadataUnpickler) -> None:
        self._spend(weight(self))
        base(self)
    return counted


def _dispatch() -> None:
    table = _MetadataUnpickler.dispatch
    for code, method in (
            (pickle.REDUCE, _MetadataUnpickler.load_reduce),
            (pickle.NEWOBJ, _MetadataUnpickler.load_newobj),
            (pickle.NEWOBJ_EX, _MetadataUnpickler.load_newobj_ex),
            (pickle.BUILD, _MetadataUnpickler.load_build),
            (pickle.APPEND, _MetadataUnpickler.load_append),
            (pickle.APPENDS, _MetadataUnpickler.load_appends),
            (pickle.SETITEM, _MetadataUnpickler.load_setitem),
            (pickle.SETITEMS, _MetadataUnpickler.load_setitems),
            (pickle.ADDITEMS, _MetadataUnpickler.load_additems),
            # protocol 0/1 instances, persistent ids, the copyreg extension registry, a copy of
            # the top of the stack: never DCP's
            *((op, _MetadataUnpickler._refuse) for op in (
                pickle.INST, pickle.OBJ, pickle.PERSID, pickle.BINPERSID, pickle.EXT1,
                pickle.EXT2, pickle.EXT4, pickle.DUP))):
        table[code[0]] = method
    for op in (pickle.EMPTY_LIST, pickle.EMPTY_DICT, pickle.EMPTY_SET, pickle.EMPTY_TUPLE,
               pickle.TUPLE1, pickle.TUPLE2, pickle.TUPLE3):
        table[op[0]] = _counting(table[op[0]], lambda self: 1)
    for op in (pickle.LIST, pickle.DICT, pickle.TUPLE, pickle.FROZENSET):  # since the MARK:
        table[op[0]] = _counting(table[op[0]], lambda self: 1 + len(self.stack))  # the items


_dispatch()


def read_metadata(step: Path, sizes: dict[str, int] | None = None) -> Any:
    """DCP's metadata of ``step``, read safely (`_MetadataUnpickler`, a file of this
    user's, bounded) and checked: a Metadata whose shards are files of ``step`` within their
    sizes. CheckpointError names the file when it is not."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import Metadata

    path = step / METADATA
    sizes = files.check_private_files(step, fix=_FIX) if sizes is None else sizes
    try:
        raw = files.read_bytes(path, max_bytes=MAX_METADATA_BYTES)
        metadata = _MetadataUnpickler(io.BytesIO(raw), _entry_budget(len(raw))).load()
    except UnsafePathError:
        raise
    except (OSError, FileFormatError) as exc:
        raise CheckpointError(str(path), _problem(exc)) from None
    except Exception as exc:  # a truncated or hostile pickle: EOFError, UnpicklingError, ...
        raise CheckpointError(str(path), _problem(exc)) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict) \
            or not isinstance(metadata.state_dict_metadata, dict):
        raise CheckpointError(str(path), f"it holds a {type(metadata).__name__}, not DCP's "
                              "Metadata")
    for info in metadata.storage_data.values():
        if not isinstance(info, _StorageInfo) or not isinstance(info.relative_path, str) \
                or not files.safe_name(info.relative_path) \
                or info.relative_path not in sizes or info.relative_path in (META, LATEST):
            raise CheckpointError(str(path), "it names a shard that is not a file of its step")
        if not (isinstance(info.offset, int) and isinstance(info.length, int)
                and info.offset >= 0 and info.length >= 0
                and info.offset + info.length <= sizes[info.relative_path]):
            raise CheckpointError(str(step / info.relative_path),
                                  "shorter than its metadata says (truncated)")
    _check_chunks(path, metadata, sum(1 for name in sizes if name not in (META, LATEST,
                                                                           METADATA)))
    return metadata


def _check_chunks(path: Path, metadata: Any, shard_files: int) -> None:
    """Every tensor's chunks are distinct, inside the tensor, each stored (a ``storage_data``
    entry of its own) and at most `_CHUNKS_PER_FILE` per shard file: what DCP's planner walks
    on a load is bounded by the step's files, not by how often a pickle repeats one chunk."""
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        MetadataIndex,
        TensorStorageMetadata,
    )

    stored = {(index.fqn, index.offset) for index in metadata.storage_data
              if isinstance(index, MetadataIndex) and isinstance(index.offset, tuple)}
    most = _CHUNKS_PER_FILE * max(1, shard_files)
    for fqn, item in metadata.state_dict_metadata.items():
        if isinstance(item, BytesStorageMetadata):
            continue
        if not isinstance(item, TensorStorageMetadata) or not isinstance(item.chunks, list) \
                or not isinstance(item.size, tuple):
            raise CheckpointError(str(path), "it holds an entry that is not DCP's")
        if len(item.chunks) > most:
            raise CheckpointError(str(path), f"{len(item.chunks)} chunks of one tensor, more "
                                  f"than {_CHUNKS_PER_FILE} per shard file")
        seen = set()
        for chunk in item.chunks:
            if not isinstance(chunk, ChunkStorageMetadata) \
                    or not isinstance(chunk.offsets, tuple) or not isinstance(chunk.sizes, tuple) \
                    or not len(chunk.offsets) == len(chunk.sizes) == len(item.size) \
                    or not all(isinstance(o, int) and isinstance(n, int) and o >= 0
                               and n >= 0 and o + n <= whole for o, n, whole
                               in zip(chunk.offsets, chunk.sizes, item.size, strict=True)):
                raise CheckpointError(str(path), "a chunk outside its tensor")
            key = (fqn, chunk.offsets)
            if key in seen or key not in stored:
                raise CheckpointError(str(path), "a chunk repeated or not stored")
            seen.add(key)


def _reader(step: Path, metadata: Any) -> Any:
    """A FileSystemReader of ``step`` that hands DCP the metadata read above (never DCP's own
    ``pickle.load``) and opens each shard with the rules of `files.open_owned`."""
    from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _OwnedFiles(FileSystem):
        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Any:
            if mode != "rb":
                raise UnsafePathError(str(path), "would be written by a reader", _FIX)
            with files.open_owned(Path(path)) as fh:
                yield fh

    class _Reader(FileSystemReader):
        def read_metadata(self, *args: Any) -> Any:  # no **kwargs: no per-rank fallback
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    reader = _Reader(step)
    reader.fs = _OwnedFiles()
    return reader


def _planner() -> Any:
    """DCP's load planner, but non-tensor values (the optimizer's hyper-parameters) read with
    ``weights_only=True`` (DCP's own planner unpickles them with ``weights_only=False``)."""
    import torch
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class _Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn],
                            obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _Planner()


def _write_atomic(path: Path, write: Any) -> None:
    with files.atomic_writer(path, what="the sharded checkpoint") as fh:  # mode 0600
        write(fh)


def _prune(root: Path, keep: str) -> None:
    """Keep the `KEEP` newest steps (and ``keep``, the one just saved); never one newer
    than ``keep``; never through a symlink."""
    names = sorted(p for p in os.listdir(root) if _STEP.fullmatch(p))
    for name in names[:-KEEP]:
        if name < keep and stat.S_ISDIR(os.lstat(root / name).st_mode):
            shutil.rmtree(root / name, ignore_errors=True)
