"""Accelerate: ``Accelerator`` keyword arguments from a Selection.

::

    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=256)
    from resilient_strategy.integrations.accelerate import make_accelerator
    accelerator = make_accelerator(sel)      # or Accelerator(**accelerator_kwargs(sel))
    model, opt, loader = accelerator.prepare(model, opt, DataLoader(data, batch_size=sel.batch_size))
    for x, y in loader:
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y)); opt.step(); opt.zero_grad()

``gradient_accumulation_steps`` (the global batch stays exact), ``mixed_precision``, ``cpu``, and
``kwargs_handlers=[InitProcessGroupKwargs(backend=..., timeout=...)]`` with the proven backend and
the training timeout; when the selection shards (``sel.sharded``), ``fsdp_plugin``: Accelerate's
``FullyShardedDataParallelPlugin`` for FSDP2 (``fsdp_version=2``, sharded state dicts, and
``shard_modules`` wrapped one by one when given: ``accelerator_kwargs(sel, shard_modules=[Block])``).
It works under ``accelerate launch`` as under ``torchrun`` (both set the
same variables). Under a launcher, a rank the choice leaves idle (a one-device fallback) exits
cleanly (status 0) here; on the rank that trains alone, :func:`make_accelerator` hides the
launcher's variables while Accelerate sets up, or it would wait for the ranks that left (with
:func:`accelerator_kwargs` alone, do that yourself). Accelerate is imported only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ExtraNotInstalledError, InvalidOptionError
from ..frameworks.teardown import end_at_exit
from . import launcher_hidden, on_gpu, precision, require_torch_selection

if TYPE_CHECKING:
    from ..selection import Selection

_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def _accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ExtraNotInstalledError("accelerate", "accelerate") from None


def accelerator_kwargs(sel: Selection, *, shard_modules: Any = None) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` that train on what ``sel`` chose
    (``shard_modules``: the module classes FSDP2 shards one by one, when it shards)."""
    require_torch_selection(sel, "Accelerate")
    sel._leave_if_idle()
    _accelerate()  # a clear error when it is missing
    kwargs: dict[str, Any] = {
        "gradient_accumulation_steps": sel.accumulation_steps,
        "mixed_precision": _MIXED[precision(sel)],
        # without cpu=True, Accelerate on a machine without CUDA would not join the ranks at all
        "cpu": not on_gpu(sel),
    }
    if sel.num_replicas > 1:
        end_at_exit()  # the group the tool starts ends at exit, barrier first
        from accelerate.utils import InitProcessGroupKwargs

        kwargs["kwargs_handlers"] = [InitProcessGroupKwargs(
            backend=sel.backend, timeout=_timeout(sel))]
    if sel.sharded and sel.num_replicas > 1:
        kwargs["fsdp_plugin"] = _fsdp_plugin(sel, shard_modules)
    return kwargs


def _fsdp_plugin(sel: Selection, shard_modules: Any) -> Any:
    from accelerate.utils import FullyShardedDataParallelPlugin

    names = [c.__name__ for c in shard_modules] if shard_modules else None
    return FullyShardedDataParallelPlugin(
        fsdp_version=2, reshard_after_forward=True, state_dict_type="SHARDED_STATE_DICT",
        auto_wrap_policy="transformer_based_wrap" if names else None,
        transformer_cls_names_to_wrap=names)


def make_accelerator(sel: Selection, *, shard_modules: Any = None, **overrides: Any) -> Any:
    """An ``accelerate.Accelerator`` for ``sel`` (``overrides`` add or replace keyword
    arguments; ``kwargs_handlers`` given here are added to ours)."""
    kwargs = accelerator_kwargs(sel, shard_modules=shard_modules)
    extra_handlers = list(overrides.pop("kwargs_handlers", []) or [])
    if extra_handlers:
        kwargs["kwargs_handlers"] = [*kwargs.get("kwargs_handlers", []), *extra_handlers]
    clash = {"gradient_accumulation_steps"} & set(overrides)
    if clash and overrides["gradient_accumulation_steps"] != sel.accumulation_steps:
        raise InvalidOptionError(
            f"gradient_accumulation_steps={overrides['gradient_accumulation_steps']} would change "
            f"the global batch; this selection needs {sel.accumulation_steps}")
    kwargs.update(overrides)
    from accelerate import Accelerator

    with launcher_hidden(sel):
        return Accelerator(**kwargs)


def _timeout(sel: Selection) -> Any:
    from datetime import timedelta

    return timedelta(seconds=sel.process_group_timeout)
