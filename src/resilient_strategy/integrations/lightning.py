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

``callbacks``: yours (``trainer_kwargs(sel, callbacks=[...])``) and, under ``resilient-strategy
run``, one that reports each optimizer step to the supervisor like ``sel.step()`` does (the
gradient all-reduce of step ``k``, in the backward of its last micro-step, is collective ``k``), so
a rank that hangs there is seen and the job relaunched; it also fires a rehearsed
``RESILIENT_STRATEGY_TRAIN_FAULT``. The key is always there: pass your callbacks through it, not
beside it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import ExtraNotInstalledError
from ..frameworks.teardown import end_at_exit
from . import on_gpu, precision, refuse_one_process_offload, require_torch_selection

if TYPE_CHECKING:
    from ..records.handoff import TrainingReporter
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
                                state_dict_type="sharded", auto_wrap_policy=wrap,
                                **({"cpu_offload": True} if sel.offload else {}))
    raise ExtraNotInstalledError("lightning", "lightning")


def trainer_kwargs(sel: Selection, *, model_parallel: bool = False,
                   shard_modules: Any = None, callbacks: Any = None,
                   announce: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``lightning.Trainer`` that train on what ``sel`` chose
    (``model_parallel`` and ``shard_modules`` apply when it shards; ``callbacks``: yours, kept
    first; see the module docstring). ``announce``: print the decision's one line
    ([Selection.summary][resilient_strategy.selection.Selection.summary]) on the main process, as the
    plain PyTorch quick start does."""
    require_torch_selection(sel, "Lightning")
    if announce:
        sel.print(sel.summary())
    sel._leave_if_idle()
    refuse_one_process_offload(sel, "Lightning")
    ddp, single = _strategies()
    gpu = on_gpu(sel)
    kwargs: dict[str, Any] = {
        "accelerator": "gpu" if gpu else "cpu",
        "accumulate_grad_batches": sel.accumulation_steps,
        "precision": _PRECISION[precision(sel)],
        "callbacks": [*(callbacks or ()),
                      *(() if sel.progress is None else (progress_callback(sel.progress),))],
    }
    if sel.num_replicas > 1:
        end_at_exit()  # the group the tool starts ends at exit, barrier first
        launch = sel.launch
        per_node = launch.local_world_size or launch.world_size
        kwargs.update(
            devices=min(per_node, sel.world_size),  # FSDP over fewer GPUs: the first ranks
            num_nodes=launch.world_size // per_node,
            strategy=_sharded_strategy(sel, model_parallel, shard_modules) if sel.sharded
            else ddp(process_group_backend=sel.backend, timeout=_timeout(sel)),
        )
    else:
        device = f"cuda:{sel.devices[0]}" if gpu else "cpu"
        kwargs.update(devices=1, num_nodes=1, strategy=single(device=device))
    return kwargs


def _callback_base() -> Any:
    import importlib

    for name in ("lightning.pytorch.callbacks", "pytorch_lightning.callbacks"):
        try:
            return importlib.import_module(name).Callback
        except ImportError:
            continue
    raise ExtraNotInstalledError("lightning", "lightning")


def progress_callback(reporter: TrainingReporter) -> Any:
    """A Lightning ``Callback`` that reports each optimizer step through ``reporter`` (the
    supervisor's progress records, `TrainingReporter`):
    the backward of the last micro-step (``accumulate_grad_batches``) is collective ``k`` of step
    ``k``; a step is counted when ``trainer.global_step`` moves; a restored checkpoint's step count
    is reported at the start of training, and a saved one noted for the supervisor. Lightning is
    imported here, when used."""

    class ReportProgress(_callback_base()):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.last = True  # whether the running batch's backward is its step's last

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            if trainer.global_step > reporter.step:  # resumed from a checkpoint
                reporter.restored(int(trainer.global_step))

        def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any,
                                 batch_idx: int) -> None:
            self.last = last_micro_step(batch_idx, trainer.accumulate_grad_batches,
                                        trainer.num_training_batches)

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            reporter.backward_begin(self.last)

        def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
            reporter.backward_end(self.last)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any,
                               batch_idx: int) -> None:
            for _ in range(max(0, int(trainer.global_step) - reporter.step)):
                reporter.stepped(True)

        def on_save_checkpoint(self, trainer: Any, pl_module: Any,
                               checkpoint: dict[str, Any]) -> None:
            where = getattr(trainer.checkpoint_callback, "dirpath", None)
            if trainer.is_global_zero and where:  # for the supervisor's relaunch line
                from ..records.handoff import note_checkpoint

                note_checkpoint(int(checkpoint.get("global_step", reporter.step)), where)

    return ReportProgress()


def last_micro_step(batch_idx: int, accumulate: int, batches: float) -> bool:
    """Whether batch ``batch_idx`` (from 0 in its epoch) ends an optimizer step: every
    ``accumulate``-th batch, and the epoch's last (Lightning steps there too; ``batches`` may be
    ``inf`` for an iterable without a length)."""
    return (batch_idx + 1) % max(1, accumulate) == 0 or batch_idx + 1 == batches


def _timeout(sel: Selection) -> Any:
    from datetime import timedelta

    return timedelta(seconds=sel.process_group_timeout)
