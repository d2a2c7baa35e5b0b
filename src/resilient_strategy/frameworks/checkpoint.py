"""Checkpoints for PyTorch training that resume on another strategy without losing a step.

``ckpt = sel.checkpoint(directory, every_steps=100)`` (before ``sel.prepare``) makes
``prepare`` restore the last checkpoint, if there is one, and ``sel.step`` write one every
``every_steps`` optimizer steps and/or ``every_seconds`` seconds: the model (unwrapped from DDP),
the optimizer, the GradScaler, the sampler's epoch and position, the optimizer step count and the
RNG states. Rank 0 alone writes, atomically (a temporary file renamed over the last one).

Asynchronous by default (`checkpoint_writer`): the step that saves pays for a copy of the state
in host memory, and a background thread writes it, at most one write in flight (a new save
waits for the previous one); a resume, ``sel.shutdown()`` and the exit wait for it, and a failed
write is raised at the next optimizer step. Async is the default because it keeps every promise
of the synchronous save (the same state at the same step, published only when whole, a resume
reading only complete checkpoints, the same typed error for a full disk) and takes the write off
the step; its price is one host copy of the state, held between saves: where that copy would not
fit half the memory available, the checkpointer writes synchronously and says so.
``asynchronous=False`` (``sel.checkpoint(..., asynchronous=False)`` or
``RESILIENT_STRATEGY_CHECKPOINT_ASYNC=0``) writes in the step, as before.

The position is kept in *samples of the epoch's order*, not in batches of one rank: the training
loader is sharded by a `ResumableSampler`, which orders an epoch the same way for any
number of replicas (DistributedSampler's seeded permutation) and gives optimizer step ``k`` the
same set of samples whether it runs as 2 replicas x 128 or 1 replica x 2 micro-steps of 128. So
after a relaunch with a different replica count the optimizer steps done before the checkpoint
are not redone, none are skipped, and each remaining sample is seen once in the epoch.

Call ``sel.set_epoch(epoch)`` at the start of each epoch and start the epoch loop at
``ckpt.epoch``. torch is imported only inside methods.

Files (the decision cache's rules, `resilient_strategy.machine.files`): the directory must
be this user's own and not writable by group or others (created 0700 when absent); a checkpoint
is read only when it is a regular file of this user's, not through a symlink, never with
``weights_only=False``. Each save keeps the one before as ``checkpoint.prev.pt`` (a hard link,
so ``checkpoint.pt`` is always whole); the temporary file of a writer killed mid-write
(``.tmp-<pid>-...``) is never read, and is swept at the next restore; a damaged latest
checkpoint is set aside as
``.corrupt`` with a warning and the previous one is loaded; with none to fall back to, a
`CheckpointError` names the file.

A sharded model (FSDP2) is saved through ``torch.distributed.checkpoint`` instead, every rank
writing its shards (`sharded_checkpoint`, under the same rules; asynchronously through DCP's
``async_save``, its collectives on a gloo group of the checkpointer's own); restoring checks the
directory first, then takes its newest checkpoint, sharded or not, into whatever the relaunch
trains. A full or read-only disk at a save is a NoSpaceError naming the file, the last
checkpoint kept.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ..errors import CheckpointError, InvalidOptionError, UnsafePathError
from ..machine import files
from . import checkpoint_writer

log = logging.getLogger("resilient_strategy")

FILE_NAME = "checkpoint.pt"
PREVIOUS_NAME = "checkpoint.prev.pt"
FORMAT_VERSION = 1
#: The keys a checkpoint of this format holds (what `Checkpointer.state_dict` writes).
_KEYS = ("version", "model", "optimizer", "scaler", "epoch", "samples_in_epoch",
         "optimizer_steps", "world_size", "rng")


@functools.cache
def resumable_sampler_class() -> type[Any]:
    """`ResumableSampler` (built on first use: it subclasses torch's DistributedSampler)."""
    from torch.utils.data.distributed import DistributedSampler

    class ResumableSampler(DistributedSampler):  # type: ignore[type-arg]
        """DistributedSampler whose next epoch can start ``skip`` samples into the epoch's order
        (`skip_next`), the same order for any ``num_replicas``.

        Never padded with repeated samples (DistributedSampler repeats the first ones so that
        every rank draws as many, which makes the epoch depend on the replica count): rank
        ``r`` draws positions ``r, r + W, ...`` of what is left of the order, so micro-step
        ``j`` of every rank together is positions ``j*W*b .. (j+1)*W*b`` (``b`` the
        ``micro_batch``) at any ``W``. When the epoch's last micro-step leaves a rank no sample,
        the rank draws one filler (the order's first sample left) so that every rank runs as
        many micro-steps (DDP's collectives); `TorchRuntime` weighs it zero.
        With ``drop_last`` the epoch ends at the last whole optimizer step (``num_replicas x
        micro_batch x accumulation`` samples), so that the epoch holds as many optimizer steps,
        and the same samples, for every split of the global batch."""

        _skip = 0

        def __init__(self, dataset: Any, *, micro_batch: int = 1, accumulation: int = 1,
                     **kwargs: Any) -> None:
            super().__init__(dataset, **kwargs)
            self.micro_batch = max(1, int(micro_batch))
            self.accumulation = max(1, int(accumulation))

        def skip_next(self, samples: int) -> None:
            self._skip = max(0, int(samples))

        @property
        def remaining(self) -> int:
            """Samples every rank together draws from the skip on (fillers not counted)."""
            left = max(0, len(self.dataset) - self._skip)  # type: ignore[arg-type]
            if self.drop_last:  # whole optimizer steps (a resume starts on one: skip is whole)
                left -= left % (self.num_replicas * self.micro_batch * self.accumulation)
            return left

        @property
        def micro_steps(self) -> int:
            """Micro-batches of ``micro_batch`` each rank draws from the skip on."""
            return -(-self.remaining // (self.num_replicas * self.micro_batch))

        def _own(self) -> tuple[int, bool]:
            """This rank's samples from the skip on, and whether it draws a filler too."""
            own = len(range(self.rank, self.remaining, self.num_replicas))
            return own, own <= (self.micro_steps - 1) * self.micro_batch

        def _order(self) -> list[int]:
            import torch

            n = len(self.dataset)  # type: ignore[arg-type]
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + self.epoch)
                indices: list[int] = torch.randperm(n, generator=g).tolist()
            else:
                indices = list(range(n))
            return indices

        def __iter__(self) -> Iterator[int]:
            # the skip holds for every iterator until the checkpointer ends it at the epoch's
            # first micro-step (`Checkpointer.micro_step`): a look before the loop (a peek,
            # ``len()``, a second ``iter()``) never spends the resumed position
            skip, left, (_, filler) = self._skip, self.remaining, self._own()
            order = self._order()[skip: skip + left]
            mine = order[self.rank:: self.num_replicas]
            return iter(mine + order[:1] if filler else mine)

        def __len__(self) -> int:
            own, filler = self._own()
            return own + filler

    return ResumableSampler


class Checkpointer:
    """Writes and restores one training state (see the module docstring)."""

    def __init__(
        self,
        directory: str | Path,
        *,
        every_steps: int | None = None,
        every_seconds: float | None = None,
        rank: int = 0,
        world_size: int = 1,
        clock: Callable[[], float] = time.monotonic,
        asynchronous: bool = True,
        timeout_s: float = 300.0,
        local_ranks: int = 1,
    ) -> None:
        if every_steps is None and every_seconds is None:
            every_steps = 100
        if every_steps is not None and (isinstance(every_steps, bool) or not isinstance(
                every_steps, int) or every_steps < 1):
            raise InvalidOptionError(f"every_steps must be a positive integer, not {every_steps!r}")
        if every_seconds is not None and not (isinstance(every_seconds, (int, float))
                                              and every_seconds > 0):
            raise InvalidOptionError(f"every_seconds must be positive, not {every_seconds!r}")
        if not isinstance(asynchronous, bool):
            raise InvalidOptionError(f"asynchronous must be True or False, not {asynchronous!r}",
                                     "asynchronous")
        self.directory = Path(directory)
        self.asynchronous = asynchronous
        self.timeout_s = float(timeout_s)
        self.local_ranks = max(1, int(local_ranks))
        self.every_steps = every_steps
        self.every_seconds = None if every_seconds is None else float(every_seconds)
        self.rank = rank
        self.world_size = world_size
        self._clock = clock
        self._state = _State(saved_at=clock())
        self._writer = checkpoint_writer.Writer(self.directory)
        self._async: _Async = _Async()
        self._stall: tuple[int, float] = (0, 0.0)  # saves summed, their stall (`stall_s`)
        self._preempt_saved = False  # the one save a preemption asks for is done

    # ----- what the training loop reads ---------------------------------------------------------
    @property
    def path(self) -> Path:
        return self.directory / FILE_NAME

    @property
    def previous_path(self) -> Path:
        return self.directory / PREVIOUS_NAME

    @property
    def epoch(self) -> int:
        """The epoch to (re)start at: the restored checkpoint's, else 0."""
        return self._state.epoch

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken so far, across relaunches."""
        return self._state.optimizer_steps

    @property
    def restored_step(self) -> int | None:
        """The optimizer step count of the checkpoint restored at prepare(), else None."""
        return self._state.restored_step

    @property
    def saves(self) -> tuple[checkpoint_writer.SaveRecord, ...]:
        """Every save of this checkpointer, in order: its step, mode, what the training thread
        paid for it (``stall_s``, of it ``waited_s`` for the previous write) and how its write
        ended (`resilient_strategy.frameworks.checkpoint_writer.SaveRecord`)."""
        return tuple(self._writer.records)

    @property
    def stall_s(self) -> float:
        """Seconds the training thread spent in checkpoint saves so far (read at every step under
        `resilient-strategy run`: summed again only when a save was added; a record's
        ``stall_s`` is final once its save returned)."""
        records = self._writer.records
        if len(records) != self._stall[0]:
            self._stall = (len(records), sum(r.stall_s for r in records))
        return self._stall[1]

    def wait(self, timeout: float = checkpoint_writer.WAIT_S) -> bool:
        """Wait up to ``timeout`` seconds for the checkpoint write in flight (asynchronous
        saves); True when none is left. Raises the write's error when it failed (a full or
        read-only disk: NoSpaceError naming the file; the newest complete checkpoint stays)."""
        done = self._writer.wait(timeout)
        self._writer.raise_error()
        return done

    # ----- hooks of TorchRuntime ---------------------------------------------------------------
    def attach(self, model: Any, optimizer: Any, scaler: Any, sampler: Any,
               micro_batch: int) -> None:
        """What to save (prepare() calls it once, with the training loader's sampler)."""
        s = self._state
        s.model, s.optimizer, s.scaler, s.sampler, s.micro_batch = (
            model, optimizer, scaler, sampler, micro_batch)
        self.restore()

    def set_epoch(self, epoch: int) -> None:
        s = self._state
        if s.resume_pending and epoch == s.epoch:
            s.resume_pending = False  # the restored position holds for this epoch
            return
        s.resume_pending = s.skip_pending = False
        s.epoch, s.samples_in_epoch = epoch, 0
        if s.sampler is not None and hasattr(s.sampler, "skip_next"):
            s.sampler.skip_next(0)

    def micro_step(self, boundary: bool, stepped: bool, samples: int | None = None) -> None:
        """After each micro-step: count its samples (``samples``, of every rank together, when
        the runtime knows them: the epoch's last micro-step may be short); at an optimizer step,
        save when due."""
        s = self._state
        if s.skip_pending:  # the loop's real iteration began: the resumed position is spent
            s.skip_pending = False
            s.sampler.skip_next(0)
        s.samples_in_epoch += s.micro_batch * self.world_size if samples is None else samples
        if stepped:
            s.optimizer_steps += 1
        if not boundary:
            return
        if self._writer.failed:  # a background write failed: said at this step, as a sync one
            self._writer.raise_error()
        due = (self.every_steps is not None and stepped
               and s.optimizer_steps % self.every_steps == 0) or (
            self.every_seconds is not None
            and self._clock() - s.saved_at >= self.every_seconds)
        if not due and stepped and not self._preempt_saved and self.rank == 0 and not _sharded(
                s.model):
            # the supervisor was preempted (records/preemption): one checkpoint at this step
            from ..records.preemption import asked_here

            due = self._preempt_saved = asked_here()
        if due:
            self.save()

    # ----- saving and restoring ----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        import torch

        s = self._state
        model = getattr(s.model, "module", s.model)
        if _sharded(model):  # its tensors go through DCP (sharded_checkpoint.py), not here
            model = None
        rng: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "version": FORMAT_VERSION,
            "model": None if model is None else model.state_dict(),
            "optimizer": None if s.optimizer is None or model is None
            else s.optimizer.state_dict(),
            "scaler": None if s.scaler is None else s.scaler.state_dict(),
            "epoch": s.epoch,
            "samples_in_epoch": s.samples_in_epoch,
            "optimizer_steps": s.optimizer_steps,
            "world_size": self.world_size,
            "rng": rng,
        }

    def save(self) -> bool:
        """Checkpoint the state now: rank 0 for a replicated model (other ranks return False),
        every rank for a sharded one (a collective). Asynchronous (the default): wait for the
        previous write, copy the state to host memory, write it in the background; synchronous:
        write it before returning."""
        t0 = time.perf_counter()
        s = self._state
        s.saved_at = self._clock()
        sharded = _sharded(s.model)
        if not sharded and self.rank != 0:
            return False
        waited = self._wait_previous()
        if waited is None:
            return False
        state = self.state_dict()
        mode, reason = self._mode(sharded, state)
        record = checkpoint_writer.SaveRecord(step=s.optimizer_steps, mode=mode, stall_s=0.0,
                                    waited_s=waited, reason=reason)
        index = self._writer.record(record)
        try:
            if sharded:
                self._save_sharded(state, mode, index)
            elif mode == checkpoint_writer.ASYNC:
                copy, ready = checkpoint_writer.snapshot(state, self._async.buffers)
                self._writer.start(index, functools.partial(self._write, copy, ready,
                                                            s.optimizer_steps))
            else:
                self._write(state, None, s.optimizer_steps)
        except BaseException as exc:
            self._writer.update(index, outcome=checkpoint_writer.FAILED,
                                error=checkpoint_writer.one_line(exc),
                                stall_s=time.perf_counter() - t0)
            raise
        changes: dict[str, Any] = {"stall_s": time.perf_counter() - t0}
        if mode == checkpoint_writer.SYNC:
            changes.update(outcome=checkpoint_writer.WRITTEN, write_s=changes["stall_s"] - waited)
        self._writer.update(index, **changes)
        return self.rank == 0

    def _wait_previous(self) -> float | None:
        """Wait for the write in flight; its error is raised here. Seconds waited, or None when
        it is still running at `checkpoint_writer.WAIT_S` (this save is skipped, and said: never
        two writes in flight)."""
        if not self._writer.in_flight:
            self._writer.raise_error()
            return 0.0
        t0 = time.perf_counter()
        done = self._writer.wait(checkpoint_writer.WAIT_S)
        self._writer.raise_error()
        waited = time.perf_counter() - t0
        step = self._state.optimizer_steps
        if not done:
            log.warning("resilient_strategy: the previous checkpoint is still being written after "
                        "%.0f s; the checkpoint of step %d is skipped", waited, step)
            self._writer.record(checkpoint_writer.SaveRecord(
                step=step, mode=checkpoint_writer.ASYNC, stall_s=waited, waited_s=waited,
                outcome=checkpoint_writer.SKIPPED))
            return None
        if not self._async.said_wait:
            self._async.said_wait = True
            log.info("resilient_strategy: the checkpoint of step %d waited %.2f s for the "
                     "previous one to be written (checkpoints come faster than the disk takes "
                     "them)", step, waited)
        return waited

    def _mode(self, sharded: bool, state: dict[str, Any]) -> tuple[str, str]:
        """Asynchronous unless asked otherwise, or unless the host copy would not fit the memory
        available (decided at the first save; agreed by every rank when sharded)."""
        if not self.asynchronous:
            return checkpoint_writer.SYNC, ""
        if self._async.fits is None:
            from ..machine.host import available_memory

            if sharded:
                from . import sharded_checkpoint

                size = checkpoint_writer.tensor_bytes(sharded_checkpoint.state_dicts(
                    self._state.model, self._state.optimizer)) * self.local_ranks
            else:
                size = checkpoint_writer.tensor_bytes(state)
            fits = checkpoint_writer.fits_host(size, available_memory())
            if sharded:
                fits = self._agree(fits)
            self._async.fits = fits
            if not fits:
                log.warning("resilient_strategy: checkpoints are written synchronously: a host "
                            "copy of the training state (%d MiB) would not fit the memory "
                            "available", size >> 20)
        if self._async.fits:
            return checkpoint_writer.ASYNC, ""
        return checkpoint_writer.SYNC, "host_memory"

    def _agree(self, fits: bool) -> bool:
        """Every rank of a sharded save takes the same mode (the collectives differ)."""
        import torch
        import torch.distributed as dist

        group = self._group()
        if group is None:
            return fits
        flag = torch.tensor([int(fits)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def _group(self) -> Any:
        """The checkpoint's own gloo group (created once, by every rank), or None without a
        process group."""
        import torch.distributed as dist

        if self._async.group is None and dist.is_available() and dist.is_initialized():
            from datetime import timedelta

            self._async.group = dist.new_group(backend="gloo",
                                               timeout=timedelta(seconds=self.timeout_s))
        return self._async.group

    def _save_sharded(self, meta: dict[str, Any], mode: str, index: int) -> None:
        from ..records.handoff import note_checkpoint
        from . import sharded_checkpoint

        s, steps = self._state, self._state.optimizer_steps
        if mode == checkpoint_writer.SYNC:
            step = sharded_checkpoint.save(self.directory, s.model, s.optimizer, meta, self.rank)
            if self.rank == 0:
                note_checkpoint(steps, step)
            return
        if self._async.dcp_writer is None:
            import torch

            self._async.dcp_writer = sharded_checkpoint.private_writer(
                self.directory, cache=torch.cuda.is_available())
        meta_copy, _ = checkpoint_writer.snapshot(meta)
        step, finish = sharded_checkpoint.save_async(
            self.directory, s.model, s.optimizer, meta_copy, self.rank, group=self._group(),
            writer=self._async.dcp_writer)

        def work() -> None:
            finish()
            if self.rank == 0:
                note_checkpoint(steps, step)

        self._writer.start(index, work, collective=True)

    def _write(self, state: dict[str, Any], ready: Any, steps: int) -> None:
        """Write ``state`` as the checkpoint, atomically: a temporary file (0600) fsynced, the
        current one kept as the previous, then renamed over it. ``ready``: the host copy's
        pending GPU copies, waited for first."""
        import torch

        from ..records.handoff import note_checkpoint

        if ready is not None:
            ready.synchronize()
        with files.writing(self.path, "the checkpoint"):  # full or read-only: one line
            files.ensure_private_dir(self.directory, fix=_FIX_DIR)
            with files.atomic_writer(self.path, what="the checkpoint", suffix=".pt",
                                     prefix=f"{_TMP}{os.getpid()}-",
                                     before_replace=self._keep_previous) as fh:
                torch.save(state, fh)
        _fsync_dir(self.directory)
        note_checkpoint(steps, self.path)

    def _keep_previous(self) -> None:
        """Keep the current checkpoint as the previous one (a hard link: the current name stays
        whole throughout); best effort."""
        why = files.keep_previous(self.path, self.previous_path)
        if why is not None:
            log.info("resilient_strategy: no previous checkpoint kept (%s)", why)

    def restore(self) -> bool:
        """Load the checkpoint into what was attached, if one exists; True when it did.

        The newest checkpoint of the directory wins: a sharded one (FSDP2, written by every rank
        through DCP) is loaded with `sharded_checkpoint`. Raises UnsafePathError when the
        directory or file is not safely this user's, and CheckpointError when the checkpoint is
        damaged and no previous good one loads."""
        from . import sharded_checkpoint

        # a write of this process into the directory ends first: a resume reads only complete
        # checkpoints, and the newest of them
        checkpoint_writer.wait_for(self.directory)
        if not os.path.lexists(self.directory):
            return False
        # the one set of rules, before anything in the directory is looked at: the directory,
        # then (in sharded_checkpoint) sharded/, its steps and every file of a step
        files.check_private_dir(self.directory, fix=_FIX_DIR)
        if self.rank == 0:  # what a killed writer left (its process gone): never a checkpoint
            files.sweep_orphan_files(self.directory, (_TMP, _PREV))
        if sharded_checkpoint.newest_is_sharded(self.directory, self.path):
            st = self._state
            sharded = sharded_checkpoint.load(self.directory, getattr(st.model, "module", st.model),
                                              st.optimizer)
            if sharded is None:
                return False
            if sharded.get("version") != FORMAT_VERSION:
                raise CheckpointError(str(self.directory), "not a checkpoint of this format "
                                      f"(version {sharded.get('version')!r})")
            self._apply(sharded)
            return True
        if not os.path.lexists(self.path) and not os.path.lexists(self.previous_path):
            return False
        problems: list[tuple[Path, str]] = []
        for path in (self.path, self.previous_path):
            if not os.path.lexists(path):
                continue
            try:
                data = _load(path)
            except CheckpointError as exc:
                problems.append((path, exc.problem))
                continue
            if problems:
                bad, problem = problems[0]
                aside = bad.with_suffix(".corrupt")
                files.set_aside(bad, aside)
                log.warning("resilient_strategy: checkpoint %s is damaged (%s); kept as %s, "
                            "resuming from the previous one, %s", bad, problem, aside, path)
            self._apply(data)
            return True
        path, problem = problems[0]
        raise CheckpointError(str(path), problem + (
            f"; the previous one, {problems[1][0]}, too ({problems[1][1]})"
            if len(problems) > 1 else "; there is no previous checkpoint to fall back to"))

    def _apply(self, data: dict[str, Any]) -> None:
        import torch

        s = self._state
        model = getattr(s.model, "module", s.model)
        if model is not None and data["model"] is not None:
            model.load_state_dict(data["model"])
        if s.optimizer is not None and data["optimizer"] is not None:
            s.optimizer.load_state_dict(data["optimizer"])
        if s.scaler is not None and data["scaler"] is not None:
            s.scaler.load_state_dict(data["scaler"])
        rng = data.get("rng") or {}
        if "torch" in rng:
            torch.set_rng_state(rng["torch"])
        if "python" in rng:
            random.setstate(_as_random_state(rng["python"]))
        if "cuda" in rng and torch.cuda.is_available():
            with contextlib.suppress(RuntimeError, IndexError):
                torch.cuda.set_rng_state_all(rng["cuda"])
        s.epoch = int(data["epoch"])
        s.samples_in_epoch = int(data["samples_in_epoch"])
        s.optimizer_steps = int(data["optimizer_steps"])
        s.restored_step = s.optimizer_steps
        s.resume_pending = True
        if s.sampler is not None:
            s.sampler.set_epoch(s.epoch)
            if hasattr(s.sampler, "skip_next"):
                s.sampler.skip_next(s.samples_in_epoch)
                s.skip_pending = s.samples_in_epoch > 0


_FIX_DIR = ("Pass sel.checkpoint() a directory of your own (mode 0700), or fix this one's owner "
            "and mode (chmod go-w).")
#: The names of a write's temporary file and of the previous checkpoint's link, each followed
#: by the writer's pid (a killed writer's are swept at the next restore).
_TMP, _PREV = ".tmp-", ".prev-"


def _fsync_dir(directory: Path) -> None:
    """Make a rename in ``directory`` durable (best effort: not every filesystem allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


class _Async:
    """What asynchronous saves keep between saves: the host buffers of the copy, whether the
    copy fits the host's memory, the checkpoint's own process group and DCP writer."""

    def __init__(self) -> None:
        self.buffers: dict[tuple[Any, ...], Any] = {}
        self.fits: bool | None = None
        self.group: Any = None
        self.dcp_writer: Any = None
        self.said_wait = False


def _load(path: Path) -> dict[str, Any]:
    """A checkpoint's contents, checked for this format. UnsafePathError when the file is not
    safely this user's; CheckpointError (naming the file) for anything damaged."""
    import pickle
    import warnings

    import torch

    try:
        # torch warns about a pickle protocol it did not write before it refuses the file
        with files.open_owned(path) as fh, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            data = torch.load(fh, map_location="cpu", weights_only=True)
    except UnsafePathError:
        raise
    except (pickle.UnpicklingError, EOFError, RuntimeError, ValueError, TypeError, KeyError,
            AttributeError, IndexError, OSError) as exc:
        raise CheckpointError(str(path), _problem(exc)) from None
    if not isinstance(data, dict):
        raise CheckpointError(str(path), f"it holds a {type(data).__name__}, not a dict")
    if data.get("version") != FORMAT_VERSION:
        raise CheckpointError(str(path), f"format version {data.get('version')!r}, not "
                              f"{FORMAT_VERSION}")
    missing = [k for k in _KEYS if k not in data]
    if missing:
        raise CheckpointError(str(path), f"it lacks {', '.join(missing)}")
    for key in ("epoch", "samples_in_epoch", "optimizer_steps"):
        if isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 0:
            raise CheckpointError(str(path), f"{key} is {data[key]!r}, not a count")
    return data


def _problem(exc: BaseException) -> str:
    """An exception of torch.load in a few words, never its advice to load arbitrary pickles."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if "weights_only" in first or "weights only" in first.lower() or len(first) > 200:
        first = ""
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


def _sharded(model: Any) -> bool:
    from .fsdp import is_sharded

    return model is not None and is_sharded(model)


def _as_random_state(state: Any) -> Any:
    """random.setstate wants tuples; a round trip may have made lists of them."""
    if isinstance(state, list):
        return tuple(_as_random_state(x) for x in state)
    if isinstance(state, tuple):
        return tuple(_as_random_state(x) for x in state)
    return state


class _State:
    """The checkpointer's mutable state (one place)."""

    def __init__(self, saved_at: float) -> None:
        self.model: Any = None
        self.optimizer: Any = None
        self.scaler: Any = None
        self.sampler: Any = None
        self.micro_batch = 0
        self.epoch = 0
        self.samples_in_epoch = 0
        self.optimizer_steps = 0
        self.restored_step: int | None = None
        self.resume_pending = False
        self.skip_pending = False  # the sampler's resumed skip, until the first micro-step
        self.saved_at = saved_at
