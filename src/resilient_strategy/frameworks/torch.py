"""PyTorch runtime: process group, device, DDP, sharded loader, accumulation and precision.

Longer than ~450 lines on purpose: one runtime per framework, whose parts (group, DDP, loader,
accumulation, precision) share the runtime's state; FSDP2 and checkpoints live in their own
modules.

The same loop runs under plain ``python`` (one device, maybe accumulating) and ``torchrun``::

    rt = TorchRuntime("gloo", (), 1, 256, 128, rank=r, local_rank=r, world_size=2, timeout_s=60)
    rt.init()                                   # process group (no-op when world_size == 1)
    with rt.scope():                            # builds on this rank's GPU
        model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = rt.prepare(model, opt, loader)   # to device, DDP, DistributedSampler
    _, _, val_loader = rt.prepare(None, None, val_loader)  # more loaders: model is optional
    for epoch in range(3):
        rt.set_epoch(epoch)                     # reshuffle the shards (of every loader)
        for x, y in loader:
            with rt.accumulate(model):          # DDP no_sync() on all but the last micro-step
                with rt.autocast():
                    loss = loss_fn(model(x.to(rt.device)), y.to(rt.device))
                rt.backward(loss)               # loss / accumulation_steps, GradScaler for fp16
            rt.clip_grad_norm(model, 1.0, opt)  # optional; only on the last micro-step
            rt.step(opt)                        # steps and zeroes grads on the last micro-step
    rt.shutdown()

``step()`` returns whether the optimizer stepped: False on micro-steps that only accumulate, and
False when fp16's GradScaler skipped the step because the gradients held inf/nan. To clip (or
otherwise inspect gradients) by hand, do it when ``rt.is_last_micro_step`` and unscale first::

    if rt.is_last_micro_step:
        if rt.scaler is not None:
            rt.scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)

A loop of the script's own (``optimizer.zero_grad(); loss.backward(); optimizer.step()``, its
own DistributedSampler) is adopted instead: ``rt.init(stand_in=True)`` starts the group (a
stand-in of this process alone, `solo_group`, on a world of one) and ``model, opt =
rt.adopt(model, opt, loader)`` returns a model with ``.module`` and an optimizer that
accumulates on its own (`adopted`), every micro-batch checked against the global batch.

torch is imported inside methods only. Micro-steps left over at the end of an epoch carry into
the next one, as in Keras.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import InvalidOptionError
from ..vocab import ONE_REPLICA_BACKENDS, PRECISIONS, PROCESS_GROUP_BACKENDS
from .stepmeter import StepMeter
from .teardown import end_at_exit, end_process_group

BACKENDS = (*PROCESS_GROUP_BACKENDS, *ONE_REPLICA_BACKENDS)


@dataclass(frozen=True)
class Precision:
    """The autocast dtype; float16 also needs a GradScaler (bf16 has fp32's exponent range)."""

    dtype: str  # "bfloat16", "float16" or "float32" (no autocast)

    @property
    def grad_scaler(self) -> bool:
        return self.dtype == "float16"


def precision_policy(requested: str, compute_capability: tuple[int, int] | None) -> Precision:
    """Resolve ``requested`` for a GPU of ``compute_capability`` (None: CPU).

    "auto": bf16 from 8.0 (native there; ``torch.cuda.is_bf16_supported()`` also says True on
    older cards, through emulation); fp16 with a GradScaler on 7.x (tensor cores); fp32 below
    7.0 (consumer Pascal runs fp16 arithmetic at a fraction of fp32's rate) and on CPU.
    """
    if requested not in PRECISIONS:
        raise InvalidOptionError(f"precision must be one of {PRECISIONS}, not {requested!r}")
    if requested != "auto":
        return Precision({"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[requested])
    if compute_capability is None or compute_capability < (7, 0):
        return Precision("float32")
    return Precision("bfloat16" if compute_capability >= (8, 0) else "float16")


@dataclass
class _Progress:
    """The only mutable state: micro-steps since the last optimizer step, and every
    DistributedSampler that `TorchRuntime.prepare` made or accepted (set_epoch seeds all)."""

    micro: int = 0
    samplers: list[Any] = field(default_factory=list)
    steps: int = 0  # optimizer steps taken (without a checkpointer)
    checkpointer: Any = None  # a checkpoint.Checkpointer, set by use_checkpointer()
    prepared: bool = False  # a loader went through prepare()
    # The epoch of the training loader (the first one prepared), from set_epoch(): the
    # micro-batches left of it for this rank; the samples it started with, of every rank
    # together (``epoch_of_every_rank``: a ResumableSampler's layout over ``epoch_world``
    # ranks, this one ``epoch_rank``) or of this rank alone (1, 0: any other loader); the
    # micro-steps done since; and the samples of the optimizer step under way (every rank's).
    # None: unknown (set_epoch not called, or a loader without a length).
    train_loader: Any = None
    epoch_micro_left: int | None = None
    epoch_samples: int | None = None
    epoch_of_every_rank: bool = False
    epoch_world: int = 1
    epoch_rank: int = 0
    epoch_micro_done: int = 0
    step_samples: int = 0
    stand_in: bool = False  # a process group of one started for a script's own dist calls
    adopted: _Adopted | None = None  # set by adopt(): the loop is the script's own


@dataclass
class _Adopted:
    """What `TorchRuntime.adopt` follows of a loop that calls ``loss.backward()`` and
    ``optimizer.step()`` itself: the DDP whose gradient sync it turns off on the micro-steps
    that only accumulate, whether this micro-step's first forward was seen, the loss share of
    its gradients, the micro-batch it expects (None: the first one seen sets it) and whether
    the last micro-batch was short (the end of an epoch, when no loader was given)."""

    ddp: Any = None
    seen: bool = False
    share: float = 1.0
    expected: int | None = None
    short: bool = False
    step_seen: int = 0  # this process's samples of the optimizer step under way (no loader)
    last_n: int | None = None  # the samples of this micro-step's first forward
    own: bool = False  # the loop accumulates itself (adopt(accumulates=True)): every step applies
    params: list[Any] = field(default_factory=list)


class TorchRuntime:
    """Everything a PyTorch training loop needs from one Selection."""

    def __init__(
        self,
        backend: str,
        devices: tuple[int, ...],
        accumulation_steps: int,
        global_batch_size: int | None,
        per_replica_batch_size: int | None,
        *,
        rank: int,
        local_rank: int,
        world_size: int,
        timeout_s: float,
        precision: str = "auto",
        init_method: str = "env://",
        sharded: bool = False,
        offload: bool = False,
        own_device: int | None = None,
    ) -> None:
        if backend not in BACKENDS:
            raise InvalidOptionError(f"PyTorch has no backend {backend!r}; one of {BACKENDS}")
        if accumulation_steps < 1 or world_size < 1 or not 0 <= rank < world_size:
            raise InvalidOptionError(
                f"need accumulation_steps >= 1 and 0 <= rank < world_size, not "
                f"{accumulation_steps}, {rank}, {world_size}"
            )
        if world_size > 1 and backend not in ("nccl", "gloo"):
            raise InvalidOptionError(f"{world_size} processes need nccl or gloo, not {backend!r}")
        uses_gpu = backend in ("nccl", "single_device") or (backend == "gloo" and devices)
        if uses_gpu and not local_rank < len(devices):
            raise InvalidOptionError(f"{backend} needs a GPU for local rank {local_rank}: {devices}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) \
                or not 0 < timeout_s < float("inf"):
            raise InvalidOptionError(
                f"process_group_timeout must be a positive number of seconds, not {timeout_s!r}",
                "process_group_timeout")
        if precision not in PRECISIONS:
            raise InvalidOptionError(
                f"precision must be one of {PRECISIONS}, not {precision!r}", "precision")
        self.backend = backend
        self.devices = tuple(devices)
        self.accumulation_steps = accumulation_steps
        self.global_batch_size = global_batch_size
        self.per_replica_batch_size = per_replica_batch_size
        self.rank = rank
        self.local_rank = local_rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.requested_precision = precision
        self.init_method = init_method
        #: the CUDA ordinal of this process's own GPU where the scheduler bound each process to
        #: its own (Selection.bound_ordinal); None: ``devices[local_rank]``
        self.own_device = own_device
        #: FSDP2 (frameworks/fsdp.py) instead of DDP when several processes train, or on one
        #: process whose state is offloaded to the host (CPUOffloadPolicy)
        self.offload = bool(offload) and bool(sharded)
        self.sharded = bool(sharded) and (world_size > 1 or self.offload)
        self._progress = _Progress()
        #: measures the user's own step over a window after the warm-up (`stepmeter`); its
        #: ``on_done`` is the Selection's; ``meter.live = False`` before training measures nothing
        self.meter = StepMeter()
        if world_size > 1:  # until prepare / adopt wraps the model in DDP (attach_ddp)
            self.meter.how, self.meter.note = "not_separated", "the model was not prepared here"

    # ----- where to run ------------------------------------------------------------------------
    @functools.cached_property
    def device(self) -> Any:
        """``cuda:{devices[local_rank]}`` for GPU backends (gloo too, when given GPUs), or this
        process's own GPU where the scheduler bound it (``own_device``); else cpu."""
        import torch

        if self.backend != "cpu" and self.devices:
            if self.own_device is not None:
                return torch.device("cuda", self.own_device)
            return torch.device("cuda", self.devices[self.local_rank])
        return torch.device("cpu")

    @functools.cached_property
    def precision(self) -> Precision:
        import torch

        if self.device.type != "cuda":
            return precision_policy(self.requested_precision, None)
        major, minor = torch.cuda.get_device_capability(self.device)
        return precision_policy(self.requested_precision, (int(major), int(minor)))

    @functools.cached_property
    def scaler(self) -> Any:
        """The GradScaler for fp16, else None (use it for ``unscale_`` before clipping)."""
        import torch

        return torch.amp.GradScaler(self.device.type) if self.precision.grad_scaler else None

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    # ----- process group -----------------------------------------------------------------------
    def init(self, *, stand_in: bool = False) -> None:
        """Join the process group when world_size > 1, or a group of this process alone for
        FSDP2 on one GPU with CPU offload (idempotent). ``stand_in``: in a world of one, start
        a default process group of this process alone (`solo_group`: no gloo, no socket), so
        that a script's own ``DistributedSampler(dataset)``, ``dist.get_rank()`` and
        ``destroy_process_group()`` work on a one-device fallback too."""
        if self.world_size == 1 and not self.sharded and not stand_in:
            return
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
            return
        if self.world_size == 1 and not self.sharded:
            from . import solo_group

            solo_group.start(self.timeout_s)
            self._progress.stand_in = True
            end_at_exit()
            return
        if self.world_size == 1:  # FSDP2 needs a process group, even of one
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            store = dist.HashStore()  # type: ignore[attr-defined]
            dist.init_process_group(backend=backend, store=store, rank=0, world_size=1,
                                    timeout=timedelta(seconds=self.timeout_s))
            end_at_exit()
            return
        kwargs: dict[str, Any] = {}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            # device_id (torch >= 2.3) binds the NCCL communicator to this GPU eagerly.
            if self.backend == "nccl" and "device_id" in inspect.signature(
                dist.init_process_group
            ).parameters:
                kwargs["device_id"] = self.device
        dist.init_process_group(
            backend=self.backend, init_method=self.init_method, rank=self.rank,
            world_size=self.world_size, timeout=timedelta(seconds=self.timeout_s), **kwargs,
        )
        end_at_exit()  # also collects garbage at exit, while the interpreter still runs

    def device_progress(self, writer: Any, start_k: int) -> Any:
        """A `DevicePoller` that follows each
        gradient all-reduce to its completion on this rank's GPU (a CUDA event recorded on the
        current stream after the backward, polled from a thread), so that the supervisor tells
        "enqueued, never completed" from "completed" under NCCL, where a collective returns
        when enqueued. None for gloo and CPU (their collectives complete before returning) and
        for a writer that writes nowhere."""
        if self.backend != "nccl" or self.device.type != "cuda" or not writer.enabled:
            return None
        import torch

        from ..records.progress import DevicePoller

        def mark() -> Any:
            event = torch.cuda.Event()  # type: ignore[no-untyped-call]
            event.record()
            return event

        return DevicePoller(writer, mark, start_k=start_k)

    def shutdown(self) -> None:
        """Wait for the checkpoint write in flight (its error is raised here), then destroy the
        process group, if one is up (idempotent)."""
        ckpt = self._progress.checkpointer
        if ckpt is not None:
            ckpt.wait()
        if self.world_size == 1 and not self.sharded and not self._progress.stand_in:
            return
        # Every rank reaches here before any tears down: destroying a gloo group while a peer
        # is still mid-teardown aborts the process ("terminate called without an active
        # exception"; pytorch/pytorch#179291). The barrier has the group's timeout.
        end_process_group(self.timeout_s)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Make this rank's GPU the current and default device, so models build on it."""
        import torch

        if self.device.type != "cuda":
            yield
            return
        with torch.cuda.device(self.device), self.device:
            yield

    # ----- model and data ----------------------------------------------------------------------
    def prepare(
        self, model: Any = None, optimizer: Any = None, loader: Any = None, *,
        shard_modules: Any = None, **ddp_kwargs: Any
    ) -> tuple[Any, Any, Any]:
        """Move the model to the device (DDP-wrapped when world_size > 1) and rebuild the loader
        with a DistributedSampler and the per-replica batch; returns ``(model, optimizer,
        loader)``.

        Each of the three is optional and comes back as None when not given, so further loaders
        go through ``prepare(None, None, val_loader)``; every DistributedSampler made on the way
        is kept, and `set_epoch` seeds them all. A model that already is a
        DistributedDataParallel is returned as is (never wrapped twice). A loader that already
        has a DistributedSampler is kept when its ``num_replicas`` and ``rank`` match this
        runtime (rebuilt, around the same sampler, only when the batch size must change) and
        refused otherwise. The optimizer is returned as is: ``.to()`` keeps the parameter
        objects, so one built before prepare still applies.

        ``ddp_kwargs`` go to ``DistributedDataParallel`` (``find_unused_parameters=True``,
        ``static_graph=True``, ``bucket_cap_mb=...``, ...). Their names are checked on every
        run, but they are ignored when world_size == 1, where nothing is wrapped.
        ``device_ids`` and ``output_device`` are this runtime's to choose.

        Sharded (FSDP2, `fsdp`): ``fully_shard`` on the module classes in
        ``shard_modules`` (default: the model's repeated blocks), then the root, and the
        optimizer pointed at the sharded parameters; the keyword arguments go to
        ``fully_shard`` (``reshard_after_forward=False``, ...). ``shard_modules`` is ignored
        when the decision replicates, so one script runs under every decision.
        """
        if self.sharded:
            from .fsdp import check_kwargs

            check_kwargs(ddp_kwargs, offload=self.offload)
        else:
            self._check_ddp_kwargs(ddp_kwargs)
        self.init()
        if model is not None and self.sharded:
            from .fsdp import shard

            model, optimizer = shard(model, optimizer, device=self.device,
                                     world_size=self.world_size, dtype=self.precision.dtype,
                                     classes=shard_modules, offload=self.offload,
                                     **ddp_kwargs)
            self.meter.device = self.device
            self.meter.how = "not_separated"
            self.meter.note = "FSDP2 runs its collectives inside its own hooks: not timed"
        elif model is not None:
            model = self._wrap(model, ddp_kwargs)
        first_loader = loader is not None and not self._progress.prepared
        if loader is not None:
            loader = self._shard(loader)
            if first_loader:
                self._progress.train_loader = loader
            self._progress.prepared = True
        ckpt = self._progress.checkpointer
        if ckpt is not None and model is not None:
            # the training loader is the first one prepared (with the model or before it)
            sampler = getattr(loader, "sampler", None) if first_loader else None
            batch = getattr(loader, "batch_size", None) if first_loader else None
            ckpt.attach(model, optimizer, self.scaler, sampler,
                        int(batch or self.per_replica_batch_size or 0))
        return model, optimizer, loader

    # ----- a loop of the script's own -----------------------------------------------------------
    def adopt(self, model: Any, optimizer: Any, loader: Any = None, *, reporter: Any = None,
              accumulates: bool = False, **ddp_kwargs: Any) -> tuple[Any, Any]:
        """Hand a loop that calls ``optimizer.zero_grad()``, ``loss.backward()`` and
        ``optimizer.step()`` itself what it needs to train on this decision; returns
        ``(model, optimizer)`` (`adopted`).

        The process group is up first (a stand-in of this process alone on a world of one), so
        the script's own ``DistributedSampler(dataset)`` works. The model comes back on this
        rank's device, as a ``DistributedDataParallel`` when several processes train, else as
        `adopted.alone_class` (``.module`` and ``no_sync()`` either way). Its forward (with
        gradients on) marks a micro-step: DDP's gradient sync is off on the micro-steps that only
        accumulate, every parameter's gradient is weighed by its micro-batch's share of the
        optimizer step (1 / accumulation_steps for full ones, as `backward` does), and the
        micro-batch is checked against the decision's (`GlobalBatchError` at the first one that
        differs). The optimizer's ``step()`` applies only on the last micro-step.

        ``loader``: the training loader (with the script's own DistributedSampler, or one
        `prepare` made): its length tells where each epoch ends, so that an optimizer step never
        spans two epochs (as under the strategy it replaces) and each micro-batch's samples are
        checked exactly. Without it the epoch's short last micro-batch ends its optimizer step.
        ``reporter``: the supervisor's progress reports (`Selection.progress`), or None.

        ``accumulates``: the loop accumulates itself, over as many forward/backward passes per
        ``optimizer.step()`` as it computes from the world size it reads (nanoGPT's
        ``gradient_accumulation_steps //= world_size``, with ``dist.get_world_size()``: 1 on a
        one-device fallback). Then every ``step()`` applies, the loop's own
        ``require_backward_grad_sync`` / ``no_sync()`` and loss scaling are left alone, and the
        global batch is checked at each optimizer step: the samples of all its forwards with
        gradients, times the processes that train, must be the decision's global batch
        (``global_batch_size=`` is then required), else `GlobalBatchError`."""
        from torch.nn.parallel import DistributedDataParallel

        from . import adopted

        p = self._progress
        self._check_adoption(loader, accumulates, ddp_kwargs)
        self.init(stand_in=True)
        wrapped = self._wrap(model, ddp_kwargs)
        ddp = wrapped if isinstance(wrapped, DistributedDataParallel) else None
        if ddp is None:
            wrapped = adopted.alone_class()(wrapped)
        state = _Adopted(ddp=ddp, expected=self.per_replica_batch_size, own=accumulates)
        p.adopted = state
        if loader is not None and not accumulates:
            self._adopt_loader(loader)
        module = wrapped.module
        if p.checkpointer is not None:
            p.checkpointer.attach(module, optimizer, None, loader.sampler,
                                  int(loader.batch_size or 0))
            if reporter is not None and self.optimizer_steps:
                reporter.restored(self.optimizer_steps)
        if loader is not None and not accumulates:
            self._start_epoch()  # after a restore: what is left of its epoch
        wrapped.register_forward_pre_hook(
            functools.partial(self._adopted_forward, reporter), with_kwargs=True)
        state.params = [param for param in module.parameters() if param.requires_grad]
        for param in state.params:
            param.register_hook(self._adopted_grad)
        step = functools.partial(self._adopted_step, optimizer, reporter)
        return wrapped, adopted.optimizer_class()(optimizer, step, lambda: p.micro == 0)

    def _check_adoption(self, loader: Any, accumulates: bool, ddp_kwargs: dict[str, Any]) -> None:
        """What `adopt` refuses before it changes anything (`InvalidOptionError`)."""
        p = self._progress
        if self.sharded:
            raise InvalidOptionError(
                "this decision shards the model (FSDP2): train it through sel.prepare(...) and "
                "sel.backward / sel.step, which shard it; sel.adopt replicates")
        if p.adopted is not None:
            raise InvalidOptionError("sel.adopt(...) adopts one training loop: call it once")
        self._check_ddp_kwargs(ddp_kwargs)
        if accumulates and (self.global_batch_size is None or p.checkpointer is not None):
            raise InvalidOptionError(
                "sel.adopt(..., accumulates=True) checks each optimizer step against the global "
                "batch: pass global_batch_size= to resilient_strategy() (the samples of one "
                "optimizer step over every process), and keep the loop's own checkpoint "
                "(sel.checkpoint(...) needs the library's accumulation)", "accumulates")
        if p.checkpointer is not None and (loader is None or loader is not p.train_loader):
            raise InvalidOptionError(
                "with sel.checkpoint(...), pass the training loader through "
                "sel.prepare(None, None, loader) first (it resumes mid-epoch there), then that "
                "loader to sel.adopt(model, optimizer, loader)")

    def _adopt_loader(self, loader: Any) -> None:
        """The adopted loop's training loader: its batch checked against the decision's, kept
        as the loader the epochs are counted on, its sampler's epochs set (`adopt`)."""
        p = self._progress
        batch = getattr(loader, "batch_size", None)
        if self.per_replica_batch_size is not None and batch != self.per_replica_batch_size:
            from ..errors import GlobalBatchError

            raise GlobalBatchError(0, self.per_replica_batch_size, int(batch or 0),
                                   "the loader's batch_size")
        if not p.prepared:
            p.train_loader = loader
            p.prepared = True
        sampler = getattr(loader, "sampler", None)
        if hasattr(sampler, "set_epoch"):
            self._register(sampler)

    def _adopted_forward(self, reporter: Any, module: Any, args: Any, kwargs: Any) -> None:
        """The first forward with gradients of each micro-step: the epoch, the batch check,
        the gradients' share, DDP's sync on the last micro-step only."""
        import torch

        from . import adopted

        p, a = self._progress, self._progress.adopted
        if a is None or not torch.is_grad_enabled():
            return
        if a.own:  # every forward of the step counts; the loop's own sync and scaling
            a.step_seen += adopted.batch_of(tuple(args), dict(kwargs)) or 0
            a.last_n = a.step_seen  # the step's samples so far (the step measurement's)
            if not a.seen and reporter is not None:
                reporter.backward_begin(True)
            a.seen = True
            return
        if a.seen:
            return
        a.seen = True
        if p.train_loader is not None and p.micro == 0 and p.epoch_micro_left == 0:
            self._start_epoch()  # the loader's next epoch (sel.set_epoch starts one too)
        n = adopted.batch_of(tuple(args), dict(kwargs))
        self._check_micro_batch(n)
        a.last_n = n
        if p.train_loader is not None or n is None or not a.expected:
            a.share = self._loss_share()
        else:  # the micro-batch's samples over a full optimizer step's
            a.share = n / (a.expected * self.accumulation_steps)
            a.step_seen += n
        last = self.is_last_micro_step
        if a.ddp is not None:
            a.ddp.require_backward_grad_sync = last  # DDP's no_sync(), read by its forward
        if reporter is not None:
            reporter.backward_begin(last)

    def _check_micro_batch(self, n: int | None) -> None:
        """`GlobalBatchError` when this process's micro-batch is not the decision's: with the
        loader known, exactly its layout's samples for this micro-step (the epoch's last may
        be short); without, never more than the micro-batch, and never two short ones in a
        row (the epoch's end is one short micro-batch)."""
        from ..errors import GlobalBatchError

        p, a = self._progress, self._progress.adopted
        if a is None or n is None:
            return
        step = p.steps
        if p.train_loader is not None:
            want = self._micro_samples()
            if want is not None and n != want:
                raise GlobalBatchError(step, want, n, "the training loader's layout of the epoch")
            return
        if a.expected is None:
            a.expected = n
        if n > a.expected:
            raise GlobalBatchError(step, a.expected, n, "more than one micro-batch")
        if n < a.expected and a.short:
            raise GlobalBatchError(step, a.expected, n, "two short micro-batches in a row")
        a.short = n < a.expected

    def _adopted_grad(self, grad: Any) -> Any:
        """A parameter's gradient of this micro-step, weighed by its share of the step (what
        ``(loss * share).backward()`` gives, for any loss)."""
        a = self._progress.adopted
        if a is None or a.share == 1.0:
            return None
        return grad * a.share

    def _adopted_step(self, optimizer: Any, reporter: Any, closure: Any) -> Any:
        """The adopted optimizer's ``step()``: the wrapped optimizer's on the last micro-step
        (its return value), else nothing (None)."""
        out: list[Any] = []
        last = self.is_last_micro_step
        if reporter is not None:
            reporter.backward_end(last)

        a = self._progress.adopted or _Adopted()

        def apply() -> bool:
            if a.own:
                self._check_own_step(a.step_seen)
                a.step_seen = 0
                out.append(optimizer.step() if closure is None else optimizer.step(closure))
                return True
            full = (a.expected or 0) * self.accumulation_steps
            if 0 < a.step_seen < full:  # a short last step (no loader known): its samples'
                for param in a.params:  # mean, as a full step's
                    if param.grad is not None:
                        param.grad.mul_(full / a.step_seen)
            a.step_seen = 0
            out.append(optimizer.step() if closure is None else optimizer.step(closure))
            return True

        stepped = self._end_micro_step(apply)
        if reporter is not None:
            reporter.checkpoint_stalled(self.checkpoint_stall_s)
            reporter.stepped(stepped)
        return out[0] if out else None

    def _check_own_step(self, seen: int) -> None:
        """`GlobalBatchError` when an optimizer step of a loop that accumulates itself saw
        other than its share of the global batch (the global batch over the processes that
        train: the loop's accumulation did not follow the decision's world size)."""
        from ..errors import GlobalBatchError

        want = (self.global_batch_size or 0) // self.world_size
        if seen != want:
            raise GlobalBatchError(
                self._progress.steps, want, seen,
                f"the samples of one optimizer step: global batch {self.global_batch_size} over "
                f"{self.world_size} process(es)",
                fix="Divide the loop's accumulation by torch.distributed.get_world_size() (the "
                    "decision's processes: 1 on a one-device fallback), not by the launcher's "
                    "WORLD_SIZE.")

    def use_checkpointer(self, checkpointer: Any) -> None:
        """Checkpoint (and resume) through ``checkpointer`` (before `prepare`): the
        training loader is then sharded by a ResumableSampler, at any world size."""
        if self._progress.prepared:
            raise InvalidOptionError(
                "call sel.checkpoint(...) before sel.prepare(...): the training loader must be "
                "sharded so that it can resume mid-epoch")
        self._progress.checkpointer = checkpointer

    @property
    def optimizer_steps(self) -> int:
        """Optimizer steps taken (across relaunches, when a checkpoint was restored)."""
        ckpt = self._progress.checkpointer
        return ckpt.optimizer_steps if ckpt is not None else self._progress.steps

    @property
    def checkpoint_stall_s(self) -> float:
        """Seconds this process's checkpoint saves stalled the training thread (0 without a
        checkpointer)."""
        ckpt = self._progress.checkpointer
        return ckpt.stall_s if ckpt is not None else 0.0

    @staticmethod
    def _check_ddp_kwargs(ddp_kwargs: dict[str, Any]) -> None:
        from torch.nn.parallel import DistributedDataParallel

        ours = {"module", "device_ids", "output_device"} & ddp_kwargs.keys()
        if ours:
            raise InvalidOptionError(
                f"prepare() chooses {sorted(ours)} itself (this rank's device); drop them"
            )
        known = inspect.signature(DistributedDataParallel.__init__).parameters
        open_ended = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in known.values())
        unknown = sorted(ddp_kwargs.keys() - known.keys())
        if unknown and not open_ended:
            raise InvalidOptionError(
                f"DistributedDataParallel has no argument(s) {unknown}; "
                f"it takes {sorted(k for k in known if k not in ('self', 'module'))}"
            )

    def _wrap(self, model: Any, ddp_kwargs: dict[str, Any]) -> Any:
        from torch.nn.parallel import DistributedDataParallel

        self.meter.device = self.device
        if isinstance(model, DistributedDataParallel):
            if ddp_kwargs:
                raise InvalidOptionError(
                    "the model is already a DistributedDataParallel, so prepare() cannot apply "
                    f"{sorted(ddp_kwargs)}; pass the unwrapped module (model.module) instead"
                )
            self.meter.attach_ddp(model)
            return model
        model = model.to(self.device)
        if self.world_size == 1:
            return model
        ids = [self.device.index] if self.device.type == "cuda" else None
        ddp = DistributedDataParallel(model, device_ids=ids, **ddp_kwargs)
        self.meter.attach_ddp(ddp)
        return ddp

    def _register(self, sampler: Any) -> None:
        if not any(s is sampler for s in self._progress.samplers):
            self._progress.samplers.append(sampler)

    def _shard(self, loader: Any) -> Any:
        from torch.utils.data import DataLoader, IterableDataset, RandomSampler, SequentialSampler
        from torch.utils.data.distributed import DistributedSampler

        if loader.batch_size is None:
            raise InvalidOptionError(
                "the loader batches with its own batch_sampler, which cannot be resharded; "
                "pass a DataLoader built with batch_size= (and shuffle=), or shard it yourself"
            )
        batch = self.per_replica_batch_size or loader.batch_size
        sampler = loader.sampler
        resumable = self._progress.checkpointer is not None and not self._progress.prepared
        if resumable and isinstance(sampler, (RandomSampler, SequentialSampler)) \
                and not isinstance(loader.dataset, IterableDataset):
            from .checkpoint import resumable_sampler_class

            sampler = resumable_sampler_class()(
                loader.dataset, num_replicas=self.world_size, rank=self.rank,
                shuffle=isinstance(sampler, RandomSampler), drop_last=loader.drop_last,
                micro_batch=batch, accumulation=self.accumulation_steps,
            )
            self._register(sampler)
        elif isinstance(sampler, DistributedSampler):
            if (sampler.num_replicas, sampler.rank) != (self.world_size, self.rank):
                raise InvalidOptionError(
                    f"the loader's DistributedSampler has num_replicas={sampler.num_replicas}, "
                    f"rank={sampler.rank}, but this runtime runs world_size={self.world_size}, "
                    f"rank={self.rank}; build it with num_replicas={self.world_size}, "
                    f"rank={self.rank}, or pass the loader unsharded and prepare() shards it"
                )
            self._register(sampler)
            if batch == loader.batch_size:
                return loader
        elif self.world_size > 1:
            if isinstance(loader.dataset, IterableDataset) or not isinstance(
                sampler, (RandomSampler, SequentialSampler)
            ):
                raise InvalidOptionError(
                    f"cannot shard a loader with a {type(sampler).__name__} over "
                    f"{self.world_size} processes; use a map-style dataset with shuffle=True/False "
                    "or shard it yourself (DistributedSampler)"
                )
            sampler = DistributedSampler(
                loader.dataset, num_replicas=self.world_size, rank=self.rank,
                shuffle=isinstance(sampler, RandomSampler), drop_last=loader.drop_last,
            )
            self._register(sampler)
        elif batch == loader.batch_size:
            return loader
        if isinstance(loader.dataset, IterableDataset):
            sampler = None
        extra = {"prefetch_factor": loader.prefetch_factor} if loader.num_workers else {}
        return DataLoader(
            loader.dataset, batch_size=batch, sampler=sampler, num_workers=loader.num_workers,
            collate_fn=loader.collate_fn, pin_memory=loader.pin_memory,
            drop_last=loader.drop_last, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, generator=loader.generator,
            multiprocessing_context=loader.multiprocessing_context,
            persistent_workers=loader.persistent_workers, **extra,
        )

    def set_epoch(self, epoch: int) -> None:
        """Seed the shuffle of every DistributedSampler that `prepare` made or accepted,
        for this epoch (no-op without one). Call it at the start of each epoch."""
        for sampler in self._progress.samplers:
            sampler.set_epoch(epoch)
        if self._progress.checkpointer is not None:
            self._progress.checkpointer.set_epoch(epoch)
        self._start_epoch()

    def _start_epoch(self) -> None:
        """Measure what is left of the training loader's epoch (after a resume: from the
        checkpoint's position), so that the epoch's last micro-batch ends an optimizer step: a
        step never spans two epochs, whatever the micro-batch count per epoch. Then the steps
        per epoch are ceil(samples / global batch) for any split of the global batch into
        replicas x micro-batch x accumulation, and a relaunch on another split takes the same
        steps as the uninterrupted run. With a ResumableSampler (a checkpointed job) the count
        is of every rank together, so that each sample of a step weighs the same at any
        replica count (`_loss_share`)."""
        p = self._progress
        p.epoch_micro_left = p.epoch_samples = None
        p.epoch_of_every_rank, p.epoch_world, p.epoch_rank, p.epoch_micro_done = False, 1, 0, 0
        loader = p.train_loader
        batch = getattr(loader, "batch_size", None)
        if loader is None or not batch:
            return
        sampler: Any = getattr(loader, "sampler", None)
        if hasattr(sampler, "micro_steps") and getattr(sampler, "micro_batch", None) == batch:
            p.epoch_micro_left, p.epoch_samples = sampler.micro_steps, sampler.remaining
            p.epoch_of_every_rank = True
            p.epoch_world, p.epoch_rank = sampler.num_replicas, sampler.rank
            return
        try:
            micro, samples = len(loader), len(loader.sampler)
        except TypeError:  # an iterable dataset: no length, no epoch to measure
            return
        p.epoch_micro_left, p.epoch_samples = micro, min(samples, micro * batch)

    # ----- one training step -------------------------------------------------------------------
    @property
    def is_last_micro_step(self) -> bool:
        """Whether the next `step` applies the optimizer (always True without
        accumulation). Gradients are complete (and all-reduced under DDP) only after the
        backward of such a micro-step: clip or inspect them then, before `step`."""
        p = self._progress
        return (p.micro + 1 >= self.accumulation_steps
                or (p.adopted is not None and p.adopted.own)
                or (p.epoch_micro_left is not None and p.epoch_micro_left <= 1)
                or (p.adopted is not None and p.adopted.short and p.train_loader is None))

    def _micro_samples(self, every_rank: bool = False) -> int | None:
        """Samples of the micro-step under way, this rank's (the epoch's last may be short, or
        a filler of none) or ``every_rank``'s together; None unknown."""
        p = self._progress
        batch = getattr(p.train_loader, "batch_size", None)
        if p.epoch_samples is None or not batch:
            return None
        world, block = p.epoch_world, p.epoch_world * int(batch)
        left = p.epoch_samples - p.epoch_micro_done * block
        if every_rank:
            return max(0, min(block, left))
        return max(0, min(int(batch), -(-(left - p.epoch_rank) // world)))

    def _loss_share(self) -> float:
        """The micro-step's share of its optimizer step: its samples over the step's, times the
        replicas whose gradients DDP averages (1 / accumulation_steps for a full step), so that
        the epoch's last, short step averages over its own samples, as a run with another
        micro-batch size or replica count would; a filler micro-batch weighs nothing."""
        p = self._progress
        samples = self._micro_samples()
        batch = getattr(p.train_loader, "batch_size", None)
        if samples is None or p.epoch_samples is None or not batch:
            return 1.0 / self.accumulation_steps
        if p.micro == 0:
            block = p.epoch_world * int(batch)
            p.step_samples = min(self.accumulation_steps * block,
                                 p.epoch_samples - p.epoch_micro_done * block)
        if p.step_samples <= 0:
            return 1.0 / self.accumulation_steps
        return samples * p.epoch_world / p.step_samples

    @contextlib.contextmanager
    def accumulate(self, model: Any) -> Iterator[None]:
        """Wrap forward and backward: skips DDP's all-reduce on all but the last micro-step
        (``DistributedDataParallel.no_sync``), FSDP2's reduce-scatter likewise
        (``set_requires_gradient_sync(False)``); the gradients are still correct without it."""
        if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: set on every micro-step
            model.set_requires_gradient_sync(self.is_last_micro_step)
            yield
            return
        if self.is_last_micro_step or not hasattr(model, "no_sync"):
            yield
            return
        with model.no_sync():
            yield

    def autocast(self) -> Any:
        """Autocast to the precision policy's dtype (a no-op context for fp32)."""
        import torch

        dtype = self.precision.dtype
        if dtype == "float32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=getattr(torch, dtype))

    def backward(self, loss: Any) -> None:
        """``(loss / accumulation_steps).backward()``, through the GradScaler for fp16. (The
        epoch's last optimizer step may hold fewer micro-batches, or a short one: each then
        weighs its samples' share of that step.)"""
        share = self._loss_share()
        if share != 1.0:
            loss = loss * share
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def clip_grad_norm(
        self, model: Any, max_norm: float, optimizer: Any, *, norm_type: float = 2.0
    ) -> Any:
        """Clip the gradients of ``model`` to ``max_norm`` when `is_last_micro_step`
        (call it after `backward`, before `step`); returns the total norm before
        clipping (a tensor), or None on the micro-steps that only accumulate (nothing done).

        For fp16 it first unscales the gradients through the GradScaler (``scaler.unscale_``),
        which is why it takes the optimizer: the same loop then runs under every precision. An
        inf/nan norm means the GradScaler will skip this step (`step` returns False).
        Call it at most once per optimizer step; do not also call ``scaler.unscale_`` yourself.
        """
        if not self.is_last_micro_step:
            return None
        import torch

        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
        return torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_norm, norm_type=norm_type
        )

    def step(self, optimizer: Any) -> bool:
        """End a micro-step: on the last one, step the optimizer (through the GradScaler for
        fp16) and zero the gradients. Returns whether the optimizer stepped: False on the
        micro-steps that only accumulate, and False when the GradScaler skipped the step
        because the gradients held inf/nan (it then lowers its scale; that is how the skip is
        detected, at the cost of one device sync per optimizer step under fp16)."""
        def apply() -> bool:
            stepped = True
            if self.scaler is not None:
                scale = self.scaler.get_scale()
                self.scaler.step(optimizer)
                self.scaler.update()
                # update() multiplies the scale by backoff_factor (< 1) exactly when it skipped.
                stepped = self.scaler.get_scale() >= scale
            else:
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return stepped

        return self._end_micro_step(apply)

    def _end_micro_step(self, apply: Any) -> bool:
        """Count the micro-step; on the last one of an optimizer step, ``apply()`` (which steps
        and says whether it did). The one place micro-steps, epochs and checkpoints advance."""
        p = self._progress
        meter = self.meter if self.meter.live else None
        own = self._own_samples() if meter is not None else None
        last_of_epoch = p.epoch_micro_left is not None and p.epoch_micro_left <= 1
        # every rank's samples of this micro-step, for the checkpoint's position (a
        # ResumableSampler's layout; otherwise the checkpointer counts full micro-batches)
        samples = self._micro_samples(every_rank=True) if p.epoch_of_every_rank else None
        if p.epoch_micro_left is not None:
            p.epoch_micro_left -= 1
            p.epoch_micro_done += 1
        short = p.adopted is not None and p.adopted.short and p.train_loader is None
        if p.adopted is not None:
            p.adopted.seen = False
        p.micro += 1
        ckpt = p.checkpointer
        by_loop = p.adopted is not None and p.adopted.own
        if p.micro < self.accumulation_steps and not last_of_epoch and not short and not by_loop:
            if ckpt is not None:
                ckpt.micro_step(boundary=False, stepped=False, samples=samples)
            if meter is not None:
                meter.micro_step(False, own)
            return False
        p.micro = 0
        if meter is not None:
            meter.update_begins()
        stepped = bool(apply())
        p.steps += stepped
        if ckpt is not None:
            ckpt.micro_step(boundary=True, stepped=stepped, samples=samples)
        if meter is not None:
            meter.micro_step(True, own)
        return stepped

    def _own_samples(self) -> int | None:
        """This process's samples of the micro-step ending (for the step measurement): the
        training loader's layout, else the micro-batch the adopted loop's forward saw, else the
        decision's micro-batch; None unknown."""
        n = self._micro_samples()
        if n is None and self._progress.adopted is not None:
            n = self._progress.adopted.last_n
        return n if n is not None else self.per_replica_batch_size
