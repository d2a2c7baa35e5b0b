"""A process group of one process, for the one-device fallback of a script that keeps its own
``DistributedSampler(dataset)``, ``dist.get_rank()``, ``dist.barrier()`` or
``destroy_process_group()``: all of them need a default process group, and the decision that
left this process alone may have been taken because gloo itself is broken here (an interface
that does not exist, a firewall), so the stand-in must not need gloo, a socket or a store.

Every collective of a world of one is exact as a copy or as nothing at all: an all-reduce (any
operation but a pre-multiplied sum, refused) leaves the tensor as it is, a broadcast from rank 0
too, an all-gather or a gather copies the input into the one output slot, a reduce-scatter or a
scatter copies the one input slot into the output. Point-to-point operations have no peer and
raise. The backend is registered with torch once per process, under `BACKEND`; torch is
imported only when `start` is called.

torch's own ``fake`` backend (``torch.testing._internal.distributed.fake_pg``) is not used: it
answers every collective without computing it (its own docstring: "it would produce wrong results
for every collective"), and it lives in torch's test internals.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from typing import Any

#: The name the stand-in is registered under (``dist.get_backend()`` says it).
BACKEND = "resilient_solo"


@functools.cache
def _group_class() -> type[Any]:
    import torch.distributed as dist

    # torch's stubs type these bases' collectives by overloads a world of one has no use for
    group_base: Any = dist.ProcessGroup
    done = _done_class()

    class SoloGroup(_copies_class(done), group_base):  # type: ignore[misc]
        """The default process group of a world of one (see the module docstring)."""

        def __init__(self) -> None:
            super().__init__(0, 1)

        def size(self) -> int:
            return 1

        def getBackendName(self) -> str:  # torch's name
            return BACKEND

        def allreduce(self, tensors: Any, opts: Any = None) -> Any:
            _check_op(opts)
            return done(tensors)

        def allreduce_coalesced(self, tensors: Any, opts: Any = None) -> Any:
            _check_op(opts)
            return done(tensors)

        def reduce(self, tensors: Any, opts: Any = None) -> Any:
            _check_op(opts)
            return done(tensors)

        def broadcast(self, tensors: Any, opts: Any = None) -> Any:
            return done(tensors)

        def barrier(self, opts: Any = None) -> Any:
            return done([])

        def send(self, *args: Any) -> Any:
            raise RuntimeError("send: a world of one process has no peer")

        def recv(self, *args: Any) -> Any:
            raise RuntimeError("recv: a world of one process has no peer")

    def create(store: Any, rank: int, size: int, timeout: Any) -> Any:
        if (rank, size) != (0, 1):
            raise ValueError(f"{BACKEND} is a world of one process, not rank {rank} of {size}")
        return SoloGroup()

    dist.Backend.register_backend(BACKEND, create, devices=["cpu", "cuda"])
    return SoloGroup


def _check_op(opts: Any) -> None:
    """A pre-multiplied sum refused (the one reduction a world of one cannot leave as it is)."""
    import torch.distributed as dist

    if getattr(opts, "reduceOp", None) == dist.ReduceOp.PREMUL_SUM:
        raise NotImplementedError("a pre-multiplied sum in a world of one process")


def _done_class() -> type[Any]:
    """torch's ``Work`` of a collective that completed when it was called."""
    import torch
    import torch.distributed as dist
    from torch.futures import Future

    work_base: Any = dist.Work

    class Done(work_base):  # type: ignore[misc]
        """A collective that completed when it was called."""

        def __init__(self, result: Any) -> None:
            super().__init__()
            self._result = result

        def wait(self, timeout: Any = None) -> bool:
            return True

        def is_completed(self) -> bool:
            return True

        def is_success(self) -> bool:
            return True

        def result(self) -> list[Any]:
            return list(self._result) if isinstance(self._result, list) else []

        def get_future(self) -> Any:
            tensors = [t for t in self._result if isinstance(t, torch.Tensor)] \
                if isinstance(self._result, list) else []
            fut: Any = Future(devices=sorted({t.device for t in tensors if t.is_cuda}, key=str))
            fut.set_result(self._result)
            return fut

    return Done


def _copies_class(done: type[Any]) -> type[Any]:
    """The collectives of a world of one that move data: each a copy into the one slot."""

    class Copies:
        def allgather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            for out, inp in zip(outputs, inputs, strict=True):
                out[0].copy_(inp)
            return done(outputs)

        def _allgather_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
            output.copy_(inp.reshape(output.shape))
            return done([output])

        def allgather_into_tensor_coalesced(self, outputs: Any, inputs: Any,
                                            opts: Any = None) -> Any:
            for out, inp in zip(outputs, inputs, strict=True):
                out.copy_(inp.reshape(out.shape))
            return done(outputs)

        def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            for out, inp in zip(outputs, inputs, strict=False):
                out[0].copy_(inp)
            return done(outputs)

        def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            for out, inp in zip(outputs, inputs, strict=False):
                out.copy_(inp[0])
            return done(outputs)

        def reduce_scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            _check_op(opts)
            for out, inp in zip(outputs, inputs, strict=True):
                out.copy_(inp[0])
            return done(outputs)

        def _reduce_scatter_base(self, output: Any, inp: Any, opts: Any = None) -> Any:
            _check_op(opts)
            output.copy_(inp.reshape(output.shape))
            return done([output])

        def alltoall(self, outputs: Any, inputs: Any, opts: Any = None) -> Any:
            for out, inp in zip(outputs, inputs, strict=True):
                out.copy_(inp)
            return done(outputs)

        def alltoall_base(self, output: Any, inp: Any, *args: Any) -> Any:
            output.copy_(inp.reshape(output.shape))
            return done([output])

    return Copies


def start(timeout_s: float) -> None:
    """Make the stand-in this process's default process group (a world of one)."""
    import torch.distributed as dist

    _group_class()
    dist.init_process_group(backend=BACKEND, store=dist.HashStore(),  # type: ignore[attr-defined]
                            rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
