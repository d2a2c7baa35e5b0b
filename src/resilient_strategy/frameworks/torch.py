"""PyTorch runtime: process group, device, DDP, sharded loader, accumulation and precision.

The same loop runs under plain ``python`` (one device, maybe accumulating) and ``torchrun``::

    rt = TorchRuntime("gloo", (), 1, 256, 128, rank=r, local_rank=r, world_size=2, timeout_s=60)
    rt.init()                                   # process group (no-op when world_size == 1)
    with rt.scope():                            # builds on this rank's GPU
        model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt, loader = rt.prepare(model, opt, loader)   # to device, DDP, DistributedSampler
    for epoch in range(3):
        rt.set_epoch(epoch)                     # reshuffle the shards
        for x, y in loader:
            with rt.accumulate(model):          # DDP no_sync() on all but the last micro-step
                with rt.autocast():
                    loss = loss_fn(model(x.to(rt.device)), y.to(rt.device))
                rt.backward(loss)               # loss / accumulation_steps, GradScaler for fp16
            rt.step(opt)                        # steps and zeroes grads on the last micro-step
    rt.shutdown()

torch is imported inside methods only. Micro-steps left over at the end of an epoch carry into
the next one, as in Keras.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from ..errors import InvalidOptionError

BACKENDS = ("nccl", "gloo", "single_device", "cpu")
PRECISIONS = ("auto", "bf16", "fp16", "fp32")


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
    """The only mutable state: micro-steps since the last optimizer step, the sampler."""

    micro: int = 0
    sampler: Any = None


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
        if not timeout_s > 0 or precision not in PRECISIONS:
            raise InvalidOptionError(f"bad timeout_s={timeout_s!r} or precision={precision!r}")
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
        self._progress = _Progress()

    # ----- where to run ------------------------------------------------------------------------
    @functools.cached_property
    def device(self) -> Any:
        """``cuda:{devices[local_rank]}`` for GPU backends (gloo too, when given GPUs); else cpu."""
        import torch

        if self.backend != "cpu" and self.devices:
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
    def init(self) -> None:
        """Join the process group when world_size > 1 (idempotent)."""
        if self.world_size == 1:
            return
        import torch
        import torch.distributed as dist

        if dist.is_initialized():
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

    def shutdown(self) -> None:
        """Destroy the process group, if one is up (idempotent)."""
        if self.world_size == 1:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            # Every rank reaches here before any tears down: destroying a gloo group while a
            # peer is still mid-teardown aborts the process ("terminate called without an active
            # exception"; pytorch/pytorch#179291). The barrier has the group's timeout.
            with contextlib.suppress(RuntimeError):
                dist.barrier()
            dist.destroy_process_group()

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
        self, model: Any, optimizer: Any = None, loader: Any = None
    ) -> tuple[Any, Any, Any]:
        """Move the model to the device (DDP-wrapped when world_size > 1) and rebuild the loader
        with a DistributedSampler and the per-replica batch. The optimizer is returned as is:
        ``.to()`` keeps the parameter objects, so one built before prepare still applies."""
        self.init()
        model = model.to(self.device)
        if self.world_size > 1:
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index] if self.device.type == "cuda" else None
            model = DistributedDataParallel(model, device_ids=ids)
        if loader is not None:
            loader = self._shard(loader)
        return model, optimizer, loader

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
        if self.world_size > 1:
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
            self._progress.sampler = sampler
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
        """Seed the DistributedSampler's shuffle for this epoch (no-op without one)."""
        if self._progress.sampler is not None:
            self._progress.sampler.set_epoch(epoch)

    # ----- one training step -------------------------------------------------------------------
    @property
    def is_last_micro_step(self) -> bool:
        """Whether the next :meth:`step` applies the optimizer."""
        return self._progress.micro + 1 >= self.accumulation_steps

    @contextlib.contextmanager
    def accumulate(self, model: Any) -> Iterator[None]:
        """Wrap forward and backward: skips DDP's all-reduce on all but the last micro-step
        (``DistributedDataParallel.no_sync``); the gradients are still correct without it."""
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
        """``(loss / accumulation_steps).backward()``, through the GradScaler for fp16."""
        if self.accumulation_steps > 1:
            loss = loss / self.accumulation_steps
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        loss.backward()

    def step(self, optimizer: Any) -> bool:
        """End a micro-step: on the last one, step the optimizer (through the GradScaler for
        fp16) and zero the gradients; returns whether it stepped."""
        self._progress.micro += 1
        if self._progress.micro < self.accumulation_steps:
            return False
        self._progress.micro = 0
        if self.scaler is not None:
            self.scaler.step(optimizer)
            self.scaler.update()
        else:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return True
