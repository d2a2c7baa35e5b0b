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

``LightningCLI``: jsonargparse refuses a strategy object among the Trainer's typed arguments
(``trainer_defaults={"strategy": DDPStrategy(...)}`` is a ``ValueError``), so `lightning_cli`
passes what `trainer_kwargs` gives to the Trainer when the CLI builds it, outside the parser::

    sel = resilient_strategy.resilient_strategy(framework="torch", global_batch_size=256)
    from resilient_strategy.integrations.lightning import lightning_cli
    lightning_cli(sel, MyModel, MyDataModule, batch_size_key="data.batch_size")

A command line or config file that sets one of those Trainer arguments to another value is an
``InvalidOptionError`` naming it (it would undo the decision); ``--trainer.callbacks`` are kept
and ours added.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from ..errors import ExtraNotInstalledError, InvalidOptionError
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


#: The Trainer arguments `trainer_kwargs` sets that a CLI's configuration must leave alone.
CLI_TRAINER_KEYS = ("accelerator", "devices", "num_nodes", "strategy",
                    "accumulate_grad_batches", "precision")


def lightning_cli(sel: Selection, *args: Any, cli_class: Any = None,
                  batch_size_key: str | None = None, callbacks: Any = None,
                  model_parallel: bool = False, shard_modules: Any = None,
                  announce: bool = True, **cli_kwargs: Any) -> Any:
    """A ``LightningCLI`` (or your subclass of it, ``cli_class``) that trains on what ``sel``
    chose: ``args`` and ``cli_kwargs`` are LightningCLI's own (``model_class``,
    ``datamodule_class``, ``trainer_defaults``, ``args``, ``run`` ...); the Trainer gets
    `trainer_kwargs` (``callbacks``, ``model_parallel``, ``shard_modules`` and ``announce``
    as there) when the CLI instantiates it, past jsonargparse, which refuses a strategy object.
    ``batch_size_key``: the parsed key of this process's batch size (``"data.batch_size"``):
    left at its default it becomes ``sel.batch_size``; set to another value it is an
    ``InvalidOptionError`` (the global batch would change). A Trainer argument of
    `CLI_TRAINER_KEYS` set in the command line or a config file to another value than the
    decision's is an ``InvalidOptionError`` too. Call it right after ``resilient_strategy()``:
    a rank the decision leaves idle exits here (status 0), before parsing or any of the CLI's
    work. Returns the CLI (``.trainer``, ``.model``, ``.datamodule``)."""
    kwargs = trainer_kwargs(sel, model_parallel=model_parallel, shard_modules=shard_modules,
                            callbacks=callbacks, announce=announce)
    cls = _resilient_cli_class(cli_class if cli_class is not None else _cli_base())
    return cls(*args, resilient_selection=(sel, kwargs, batch_size_key), **cli_kwargs)


def _cli_base() -> Any:
    import importlib

    for name in ("lightning.pytorch.cli", "pytorch_lightning.cli"):
        try:
            return importlib.import_module(name).LightningCLI
        except ImportError:
            continue
    raise ExtraNotInstalledError("lightning", "lightning")


@functools.cache
def _resilient_cli_class(base: Any) -> Any:
    """``base`` (LightningCLI or a subclass) with the selection's Trainer arguments applied."""
    import inspect

    class ResilientLightningCLI(base):  # type: ignore[misc]
        def __init__(self, *args: Any, resilient_selection: tuple[Selection, dict[str, Any],
                                                                  str | None],
                     **kwargs: Any) -> None:
            self.resilient_selection, self.resilient_kwargs, self.resilient_batch_key = \
                resilient_selection
            super().__init__(*args, **kwargs)

        def _subconfig(self, config: Any) -> Any:
            return config.get(str(self.subcommand), config) if self.subcommand else config

        def before_instantiate_classes(self) -> None:
            super().before_instantiate_classes()
            key = self.resilient_batch_key
            if key is None:
                return
            sel = self.resilient_selection
            config = self._subconfig(self.config)
            default = self._parser(self.subcommand).get_defaults().get(key)
            given = config.get(key)
            if given not in (default, sel.batch_size):
                raise InvalidOptionError(
                    f"{key}={given} would change the global batch: this decision feeds "
                    f"{sel.batch_size} per process ({sel.num_replicas} replica(s) x "
                    f"{sel.batch_size} x {sel.accumulation_steps} accumulation step(s) = "
                    f"{sel.global_batch_size}); leave it out, or change global_batch_size",
                    key)
            config[key] = sel.batch_size

        def instantiate_trainer(self, **kwargs: Any) -> Any:
            config = {**self._get(self.config_init, "trainer", default={})}
            ours = dict(self.resilient_kwargs)
            ours_callbacks = list(ours.pop("callbacks", None) or ())
            try:
                params = inspect.signature(self.trainer_class).parameters
            except (TypeError, ValueError):
                params = {}  # type: ignore[assignment]
            for name, value in ours.items():
                if name not in config or name not in params:
                    continue
                given = config[name]
                if given != params[name].default and not _same(given, value):
                    raise InvalidOptionError(
                        f"trainer.{name}={given!r} is set in the command line or a config "
                        f"file, but this decision trains with {name}={_shown(value)}: leave "
                        "it out (resilient_strategy decides it)", f"trainer.{name}")
            theirs = config.get("callbacks")
            theirs = [] if theirs is None else theirs if isinstance(theirs, list) else [theirs]
            return super().instantiate_trainer(
                **{**ours, "callbacks": [*theirs, *ours_callbacks], **kwargs})

    return ResilientLightningCLI


def _same(given: Any, ours: Any) -> bool:
    return type(given) is type(ours) and given == ours and isinstance(ours, (str, int))


def _shown(value: Any) -> str:
    return repr(value) if isinstance(value, (str, int)) else type(value).__name__


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
