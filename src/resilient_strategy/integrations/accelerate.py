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
cleanly (status 0) here; on the rank that trains alone, `make_accelerator` hides the
launcher's variables while Accelerate sets up, or it would wait for the ranks that left (with
`accelerator_kwargs` alone, do that yourself). Accelerate is imported only when called.

Under ``resilient-strategy run``, `make_accelerator` also has the accelerator report each
optimizer step to the supervisor (`report_progress`; with ``Accelerator(**accelerator_kwargs(
sel))``, call ``report_progress(accelerator, sel)`` yourself, before ``prepare``): the backward of
a step's last micro-step (``accelerator.sync_gradients``) is collective ``k``, a step is counted
when the prepared optimizer really steps, ``save_state`` records the count in its directory and
``load_state`` resumes it, so a rank that hangs is seen and the job relaunched; a rehearsed
``RESILIENT_STRATEGY_TRAIN_FAULT`` fires there. Outside ``run`` nothing is added.

When the decision accumulates (``sel.accumulation_steps`` > 1: the one-device fallback), only
``accelerator.accumulate`` makes Accelerate step once per n micro-batches; a loop that
accumulates by hand (``if (step + 1) % k == 0: optimizer.step()``) or not at all would step
on every call, each step seeing 1/n of the global batch (measured before: 96 optimizer steps of
16 samples where the 2-process run took 48 of 32). `make_accelerator` therefore has the
prepared optimizer refuse a step taken without ``accelerator.accumulate`` entered since the
previous one: `AccumulateRequiredError`, at the first step (`check_accumulation`; with
``Accelerator(**accelerator_kwargs(sel))``, call it yourself before ``prepare``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..errors import (
    AccumulateRequiredError,
    ExtraNotInstalledError,
    InvalidOptionError,
    ResilientStrategyError,
)
from ..frameworks.teardown import end_at_exit
from . import (
    launcher_hidden,
    on_gpu,
    precision,
    refuse_one_process_offload,
    require_torch_selection,
)

if TYPE_CHECKING:
    from ..records.handoff import TrainingReporter
    from ..selection import Selection

_MIXED = {"bf16": "bf16", "fp16": "fp16", "fp32": "no"}


def _accelerate() -> None:
    try:
        import accelerate  # noqa: F401
    except ImportError:
        raise ExtraNotInstalledError("accelerate", "accelerate") from None


def accelerator_kwargs(sel: Selection, *, shard_modules: Any = None,
                       announce: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``accelerate.Accelerator`` that train on what ``sel`` chose
    (``shard_modules``: the module classes FSDP2 shards one by one, when it shards).
    ``announce``: print the decision's one line
    ([Selection.summary][resilient_strategy.selection.Selection.summary]) on the main process, as the
    plain PyTorch quick start does."""
    require_torch_selection(sel, "Accelerate")
    if announce:
        sel.print(sel.summary())
    sel._leave_if_idle()
    refuse_one_process_offload(sel, "Accelerate")
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
        transformer_cls_names_to_wrap=names, cpu_offload=sel.offload)


def make_accelerator(sel: Selection, *, shard_modules: Any = None, announce: bool = True,
                     **overrides: Any) -> Any:
    """An ``accelerate.Accelerator`` for ``sel`` (``overrides`` add or replace keyword
    arguments; ``kwargs_handlers`` given here are added to ours; ``announce``: as in
    [accelerator_kwargs][resilient_strategy.integrations.accelerate.accelerator_kwargs])."""
    kwargs = accelerator_kwargs(sel, shard_modules=shard_modules, announce=announce)
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
        accelerator = Accelerator(**kwargs)
    report_progress(accelerator, sel)
    check_accumulation(accelerator, sel)
    return accelerator


def check_accumulation(accelerator: Any, sel: Selection) -> None:
    """When ``sel`` accumulates, have each optimizer ``accelerator.prepare`` returns raise
    `AccumulateRequiredError` on a ``step()`` taken without ``accelerator.accumulate`` entered
    since its previous step (see the module docstring); nothing otherwise. Call it before
    ``accelerator.prepare``."""
    n = sel.accumulation_steps
    if n <= 1:
        return
    entered = [0]  # how many times accelerator.accumulate was entered
    accumulate = accelerator.accumulate
    prepare_optimizer = accelerator.prepare_optimizer

    @contextlib.contextmanager
    def counted_accumulate(*models: Any) -> Iterator[None]:
        entered[0] += 1
        with accumulate(*models):
            yield

    def checked_prepare_optimizer(optimizer: Any, device_placement: Any = None) -> Any:
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        step = prepared.step
        seen = [0]  # entries of accumulate at this optimizer's previous step

        def checked_step(*args: Any, **kwargs: Any) -> Any:
            if entered[0] == seen[0]:
                raise AccumulateRequiredError(n, sel.batch_size)
            seen[0] = entered[0]
            return step(*args, **kwargs)

        prepared.step = checked_step
        return prepared

    accelerator.accumulate = counted_accumulate
    accelerator.prepare_optimizer = checked_prepare_optimizer


#: Written by ``save_state`` (main process) under the supervisor: the optimizer steps taken.
STEPS_FILE = "resilient_strategy_steps.json"


def report_progress(accelerator: Any, sel: Selection) -> None:
    """Under ``resilient-strategy run``, report ``accelerator``'s training to the supervisor (see
    the module docstring); nothing otherwise. Call it before ``accelerator.prepare``."""
    reporter = sel.progress
    if reporter is None:
        return
    backward = accelerator.backward
    prepare_optimizer = accelerator.prepare_optimizer

    def reported_backward(loss: Any, **kwargs: Any) -> Any:
        last = bool(accelerator.sync_gradients)
        reporter.backward_begin(last)
        out = backward(loss, **kwargs)
        reporter.backward_end(last)
        return out

    def reported_prepare_optimizer(optimizer: Any, device_placement: Any = None) -> Any:
        prepared = prepare_optimizer(optimizer, device_placement=device_placement)
        inner = getattr(prepared, "optimizer", prepared)
        # fires when the optimizer really steps: not on accumulating micro-steps, nor on an
        # fp16 step the scaler skipped (Accelerate calls the inner step only then); an
        # optimizer that is no torch.optim.Optimizer has no such hook: its steps go uncounted
        register = getattr(inner, "register_step_post_hook", None)
        if register is not None:
            register(lambda *_: reporter.stepped(True))
        return prepared

    accelerator.backward = reported_backward
    accelerator.prepare_optimizer = reported_prepare_optimizer
    accelerator.register_save_state_pre_hook(
        lambda _models, _weights, output_dir: _save_steps(accelerator, reporter, output_dir))
    accelerator.register_load_state_pre_hook(
        lambda _models, input_dir: _load_steps(reporter, input_dir))


def _save_steps(accelerator: Any, reporter: TrainingReporter, output_dir: str) -> None:
    if not accelerator.is_main_process:
        return
    from ..machine.files import write_json_atomic
    from ..records.handoff import note_checkpoint

    write_json_atomic(Path(output_dir) / STEPS_FILE, {"optimizer_steps": reporter.step})
    note_checkpoint(reporter.step, output_dir)


def _load_steps(reporter: TrainingReporter, input_dir: str) -> None:
    """The count ``save_state`` recorded (none: a checkpoint saved outside the supervisor)."""
    steps = read_steps(Path(input_dir) / STEPS_FILE)
    if steps:
        reporter.restored(steps)


def read_steps(path: Path) -> int:
    """The optimizer steps recorded in ``path``; 0 when it is missing or unreadable."""
    from ..machine.files import read_json

    try:  # bounded, a regular file only (the directory is the user's)
        value = read_json(path, max_bytes=4096, owned=False).get("optimizer_steps", 0)
    except (OSError, ValueError, AttributeError, ResilientStrategyError):
        return 0
    return value if type(value) is int and value >= 0 else 0


def _timeout(sel: Selection) -> Any:
    from datetime import timedelta

    return timedelta(seconds=sel.process_group_timeout)
