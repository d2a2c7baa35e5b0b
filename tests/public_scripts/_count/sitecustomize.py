"""The public-scripts suite's instrument (tests/test_public_scripts.py), never part of a script.

On ``PYTHONPATH`` with ``PUBLIC_SCRIPTS_REPORT=<dir>`` set, every Python process that imports
torch counts what it really trained and writes it to ``<dir>/rank<RANK>-<pid>.json`` after each
optimizer step (atomically): ``steps`` (the real optimizer steps: torch's global step hook fires
on the wrapped optimizer's ``step``, never on a wrapper's call that only accumulates) and
``samples`` (the first dimension of the first tensor given to the process's training model: the
first module called at the top level with gradients on, counted on each such call). A process
that imports keras counts ``fit``'s training batches (``batches``) and the optimizer's updates
(``steps``, its ``iterations`` at the end of ``fit``) the same way. ``PUBLIC_SCRIPTS_STEP_S``: a
pause after each step (so that a test can kill a rank mid-run), none by default.

The original and the adopted script run under the same instrument, unchanged.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import sys
import time
from typing import Any

REPORT = os.environ.get("PUBLIC_SCRIPTS_REPORT")
PAUSE_S = float(os.environ.get("PUBLIC_SCRIPTS_STEP_S") or 0)
COUNTS: dict[str, Any] = {"steps": 0, "samples": 0, "batches": 0}
_STATE: dict[str, Any] = {"model": None, "depth": 0}


def _write() -> None:
    if not REPORT:
        return
    path = os.path.join(REPORT, f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.json")
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(COUNTS, fh)
    os.replace(tmp, path)


def _first_tensor_len(value: Any) -> int | None:
    import torch

    if isinstance(value, torch.Tensor):
        return int(value.shape[0]) if value.dim() > 0 else None
    if isinstance(value, (list, tuple)):
        items: Any = value
    elif isinstance(value, dict):
        items = value.values()
    else:
        return None
    for item in items:
        n = _first_tensor_len(item)
        if n is not None:
            return n
    return None


def _torch_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    COUNTS["steps"] += 1
    _write()
    if PAUSE_S:
        time.sleep(PAUSE_S)


def _forward_pre(module: Any, args: Any) -> None:
    import torch

    _STATE["depth"] += 1
    if _STATE["depth"] != 1 or not torch.is_grad_enabled():
        return
    if _STATE["model"] is None:
        _STATE["model"] = module
    if module is _STATE["model"]:
        COUNTS["samples"] += _first_tensor_len(args) or 0


def _forward_post(module: Any, args: Any, output: Any) -> None:
    _STATE["depth"] -= 1


def _keras_fit(fit: Any) -> Any:
    def counted(self: Any, *args: Any, **kwargs: Any) -> Any:
        import keras  # at fit's call: keras is imported by then

        class Count(keras.callbacks.Callback):
            def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
                COUNTS["batches"] += 1
                _write()
                if PAUSE_S:
                    time.sleep(PAUSE_S)

            def on_train_end(self, logs: Any = None) -> None:
                COUNTS["steps"] = int(self.model.optimizer.iterations.numpy())
                _write()

        kwargs["callbacks"] = [*(kwargs.get("callbacks") or []), Count()]
        return fit(self, *args, **kwargs)

    return counted


def _installed(name: str, module: Any) -> None:
    if name == "torch.optim.optimizer":
        module.register_optimizer_step_post_hook(_torch_step)
    elif name == "torch.nn.modules.module":
        module.register_module_forward_pre_hook(_forward_pre)
        module.register_module_forward_hook(_forward_post, always_call=True)
    elif name == "keras.src.backend.tensorflow.trainer":
        module.TensorFlowTrainer.fit = _keras_fit(module.TensorFlowTrainer.fit)


class _After(importlib.abc.MetaPathFinder):
    """Runs `_installed` right after one of the named modules is executed."""

    names = ("torch.optim.optimizer", "torch.nn.modules.module", "keras.src.backend.tensorflow.trainer")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.names:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _installed(name, module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if REPORT:
    sys.meta_path.insert(0, _After())
