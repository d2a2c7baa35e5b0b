"""Lightning: what ``lightning.Trainer`` needs from a Selection.

::

    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=256)
    from resilient_strategy.integrations.lightning import trainer_kwargs
    trainer = lightning.Trainer(max_epochs=3, **trainer_kwargs(sel))
    trainer.fit(model, DataLoader(data, batch_size=sel.batch_size))   # this process's batch

``accelerator``, ``devices`` and ``num_nodes``, ``strategy`` (a ``DDPStrategy`` with the proven
process-group backend and the training timeout, or a ``SingleDeviceStrategy``),
``accumulate_grad_batches`` (the global batch stays exact) and ``precision``. Call it after
``resilient_strategy()`` and before the Trainer: the selection has set its variables by then and
Lightning has not touched CUDA. Under torchrun, a rank the choice leaves idle (a one-device
fallback) exits cleanly here (status 0). Lightning is imported only when this is called.

When the selection shards (``sel.sharded``: FSDP2 was chosen, see docs/how-to/large-models.md)
the strategy is Lightning's ``FSDPStrategy`` with the same backend and timeout, sharded
checkpoints and ``auto_wrap_policy`` = the module classes in ``shard_modules`` (Lightning's own
FSDP wrapping); with ``model_parallel=True`` it is ``ModelParallelStrategy`` instead (FSDP2: your
LightningModule applies ``fully_shard`` in ``configure_model``), data-parallel over every process.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ExtraNotInstalledError
from ..frameworks.teardown import end_at_exit
from . import on_gpu, precision, require_torch_selection

if TYPE_CHECKING:
    from ..selection import Selection

_PRECISION = {"bf16": "bf16-mixed", "fp16": "16-mixed", "fp32": "32-true"}


def _strategies() -> tuple[Any, Any]:
    import importlib

    for name in ("lightning.pytorch.strategies", "pytorch_lightning.strategies"):  # or standalone
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        return mod.DDPStrategy, mod.SingleDeviceStrategy
    raise ExtraNotInstalledError("lightning", "lightning")


def _sharded_strategy(sel: Selection, model_parallel: bool, shard_modules: Any) -> Any:
    import importlib

    for name in ("lightning.pytorch.strategies", "pytorch_lightning.strategies"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        if model_parallel:
            return mod.ModelParallelStrategy(
                data_parallel_size=sel.num_replicas, tensor_parallel_size=1,
                process_group_backend=sel.backend, timeout=_timeout(sel))
        wrap = set(shard_modules) if shard_modules else None
        return mod.FSDPStrategy(process_group_backend=sel.backend, timeout=_timeout(sel),
                                state_dict_type="sharded", auto_wrap_policy=wrap)
    raise ExtraNotInstalledError("lightning", "lightning")


def trainer_kwargs(sel: Selection, *, model_parallel: bool = False,
                   shard_modules: Any = None) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that train on what ``sel`` chose
    (``model_parallel`` and ``shard_modules`` apply when it shards, see the module docstring)."""
    require_torch_selection(sel, "Lightning")
    sel._leave_if_idle()
    ddp, single = _strategies()
    gpu = on_gpu(sel)
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if gpu else "cpu",
        "accumulate_grad_batches": sel.accumulation_steps,
        "precision": _PRECISION[precision(sel)],
    }
    if sel.num_replicas > 1:
        end_at_exit()  # the group the tool starts ends at exit, barrier first
        launch = sel.launch
        per_node = launch.local_world_size or launch.world_size
        kwargs.update(
            devices=per_node,
            num_nodes=launch.world_size // per_node,
            strategy=_sharded_strategy(sel, model_parallel, shard_modules) if sel.sharded
            else ddp(process_group_backend=sel.backend, timeout=_timeout(sel)),
        )
    else:
        device = f"cuda:{sel.devices[0]}" if gpu else "cpu"
        kwargs.update(devices=1, num_nodes=1, strategy=single(device=device))
    return kwargs


def _timeout(sel: Selection) -> Any:
    from datetime import timedelta

    return timedelta(seconds=sel.process_group_timeout)
