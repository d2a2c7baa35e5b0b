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


def trainer_kwargs(sel: Selection) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that train on what ``sel`` chose."""
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
            strategy=ddp(process_group_backend=sel.backend,
                         timeout=_timeout(sel)),
        )
    else:
        device = f"cuda:{sel.devices[0]}" if gpu else "cpu"
        kwargs.update(devices=1, num_nodes=1, strategy=single(device=device))
    return kwargs


def _timeout(sel: Selection) -> Any:
    from datetime import timedelta

    return timedelta(seconds=sel.process_group_timeout_s)
