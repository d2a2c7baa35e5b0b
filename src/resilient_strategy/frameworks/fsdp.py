"""PyTorch FSDP2 (``torch.distributed.fsdp.fully_shard``) for a sharded Selection.

`shard` applies ``fully_shard`` to the units of a model (the module classes the user
names, else the model's repeated blocks, see `resilient_strategy.core.call.model.repeated_blocks`),
then to the root, on a one-dimensional device mesh over the process group the runtime joined
(the backend the probe proved). Mixed precision follows the selection's precision: bf16 / fp16
parameters for compute with fp32 gradient reduction (``MixedPrecisionPolicy``); fp32 none.

``fully_shard`` replaces each parameter by a new (DTensor) one, so an optimizer built before
`shard` would update tensors the model no longer uses; `shard` points the optimizer's
parameter groups at the new parameters, by name (what Accelerate does for FSDP2 too:
``fsdp2_switch_optimizer_parameters`` in accelerate/utils/fsdp_utils.py). An optimizer that
already has state cannot be moved so: build it, or load its state, after ``prepare``.

The accumulation contract stays the runtime's: on the micro-steps that only accumulate,
``set_requires_gradient_sync(False)`` skips the reduce-scatter (FSDP2 keeps the unsharded
gradients meanwhile, as DDP's ``no_sync`` keeps local ones); the last micro-step reduces them.
With CPU offload (the decision's ``offload``), every ``fully_shard`` call takes
``offload_policy=CPUOffloadPolicy(pin_memory=...)``: the sharded parameters, their gradients and
the optimizer's state live in host memory, parameters are copied to the GPU for the gather and
gradients back, and the optimizer steps on the CPU (the policy's docstring, torch 2.6+,
https://docs.pytorch.org/docs/stable/distributed.fsdp.fully_shard.html). Memory is pinned only
on a GPU (a CPU-only build has no pinned memory to give). Each unit is moved to the device when
it is sharded (FSDP2's ``_move_states_to_device``), so build the model on the CPU (or the meta
device) and only one unit at a time visits the GPU.

torch is imported inside functions only.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from typing import Any

from ..core.call.model import repeated_blocks
from ..errors import InvalidOptionError

__all__ = ["check_kwargs", "is_sharded", "shard", "units_of"]

#: What `shard` chooses itself: the mesh and the precision policy.
_OURS = ("mesh", "mp_policy")


def is_sharded(model: Any) -> bool:
    """Whether ``model`` went through ``fully_shard`` (an FSDP2 module)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch without FSDP2
        return False
    return isinstance(model, FSDPModule)


def check_kwargs(kwargs: dict[str, Any], offload: bool = False) -> None:
    """Refuse what ``fully_shard`` does not take, and what `shard` chooses itself (the
    offload policy too, when the decision offloads)."""
    from torch.distributed.fsdp import fully_shard

    ours = sorted(set(_OURS + (("offload_policy",) if offload else ())) & kwargs.keys())
    if ours:
        raise InvalidOptionError(f"prepare() chooses {ours} itself for FSDP2; drop them")
    target = getattr(fully_shard, "__wrapped__", fully_shard)
    known = set(inspect.signature(target).parameters) - {"module"}
    unknown = sorted(kwargs.keys() - known)
    if unknown:
        raise InvalidOptionError(f"fully_shard has no argument(s) {unknown}; it takes "
                                 f"{sorted(known - set(_OURS))}")


def units_of(model: Any, classes: Sequence[type] | None) -> list[Any]:
    """The modules to shard one by one before the root: every module (not the root) of one of
    ``classes``, outermost only; without classes, the model's repeated blocks."""
    if not classes:
        return repeated_blocks(model)
    wanted = tuple(classes)
    out: list[Any] = []
    inside: set[int] = set()
    for m in model.modules():
        if m is model or id(m) in inside:
            continue
        if isinstance(m, wanted):
            out.append(m)
            inside |= _descendants(m)
    if not out:
        raise InvalidOptionError(
            f"shard_modules={[c.__name__ for c in wanted]}: the model has no such module")
    return out


def _descendants(module: Any) -> set[int]:
    return {id(x) for x in module.modules()}


def _mixed_precision(dtype: str) -> dict[str, Any]:
    """``fully_shard``'s ``mp_policy`` for the selection's precision (none for fp32)."""
    import torch
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if dtype == "float32":
        return {}
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=getattr(torch, dtype),
                                              reduce_dtype=torch.float32)}


def shard(model: Any, optimizer: Any, *, device: Any, world_size: int, dtype: str,
          classes: Sequence[type] | None = None, offload: bool = False,
          **fsdp_kwargs: Any) -> tuple[Any, Any]:
    """``fully_shard`` the units and the root of ``model`` over ``world_size`` processes of the
    process group already joined; returns the model (the same object, now an FSDP2 module) and
    the optimizer, pointed at the sharded parameters."""
    if is_sharded(model):
        return model, optimizer
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    check_kwargs(fsdp_kwargs, offload)
    if offload:
        from torch.distributed.fsdp import CPUOffloadPolicy

        fsdp_kwargs = {**fsdp_kwargs,
                       "offload_policy": CPUOffloadPolicy(pin_memory=device.type == "cuda")}
    if optimizer is not None and len(optimizer.state):
        raise InvalidOptionError(
            "the optimizer already has state (it stepped, or loaded a state dict): FSDP2 "
            "replaces the parameters, so build the optimizer (or load its state) after prepare()")
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    mesh = init_device_mesh(device.type, (world_size,))
    policy = _mixed_precision(dtype)
    for unit in units_of(model, classes):
        fully_shard(unit, mesh=mesh, **policy, **fsdp_kwargs)
    fully_shard(model, mesh=mesh, **policy, **fsdp_kwargs)
    if optimizer is not None:
        now = dict(model.named_parameters(remove_duplicate=False))
        for group in optimizer.param_groups:
            group["params"] = [now.get(names.get(id(p), ""), p) for p in group["params"]]
    return model, optimizer
