"""The two objects `TorchRuntime.adopt` hands back to a script that keeps its own loop
(``optimizer.zero_grad(); loss = ...; loss.backward(); optimizer.step()``):

- the model: a ``DistributedDataParallel`` when several processes train, else `Alone`, a module
  with DDP's surface (``.module``, ``no_sync()``), so that ``model.module.state_dict()`` works on
  a one-device fallback too;
- the optimizer: an `AdoptedOptimizer` whose ``step()`` applies the wrapped optimizer only on
  the last micro-step of an optimizer step and whose ``zero_grad()`` clears the gradients only
  between optimizer steps, so that the decision's accumulation happens without the loop knowing.

Both are built on first use (they subclass torch's classes; torch is imported inside the
functions). An `AdoptedOptimizer` is a ``torch.optim.Optimizer`` (LR schedulers accept it) that
keeps no state of its own: ``state``, ``param_groups``, ``defaults``, ``state_dict()`` are the
wrapped optimizer's, as Accelerate's ``AcceleratedOptimizer`` does
(huggingface/accelerate, ``src/accelerate/optimizer.py``).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import Any


@functools.cache
def alone_class() -> type[Any]:
    """`Alone` (built on first use)."""
    import torch

    class Alone(torch.nn.Module):
        """The model of a process that trains alone, with DistributedDataParallel's surface:
        ``.module`` (the model itself; ``state_dict()`` keys carry DDP's ``module.`` prefix too)
        and ``no_sync()`` (nothing to skip)."""

        def __init__(self, module: Any) -> None:
            super().__init__()
            self.module = module

        def forward(self, *args: Any, **kwargs: Any) -> Any:
            return self.module(*args, **kwargs)

        @contextlib.contextmanager
        def no_sync(self) -> Iterator[None]:
            yield

    return Alone


@functools.cache
def optimizer_class() -> type[Any]:
    """`AdoptedOptimizer` (built on first use)."""
    import torch

    class AdoptedOptimizer(torch.optim.Optimizer):
        """An optimizer that steps once per optimizer step of the decision: ``step()`` on a
        micro-step that only accumulates does nothing (returns None); ``zero_grad()`` between
        the micro-steps of one optimizer step does nothing. ``optimizer`` is the one wrapped."""

        def __init__(self, optimizer: Any, step: Callable[[Any], Any],
                     between_steps: Callable[[], bool]) -> None:
            # no super().__init__(): every piece of state is the wrapped optimizer's
            self.optimizer = optimizer
            self._step = step
            self._between_steps = between_steps

        @property
        def state(self) -> Any:
            return self.optimizer.state

        @state.setter
        def state(self, value: Any) -> None:
            self.optimizer.state = value

        @property
        def param_groups(self) -> Any:
            return self.optimizer.param_groups

        @param_groups.setter
        def param_groups(self, value: Any) -> None:
            self.optimizer.param_groups = value

        @property
        def defaults(self) -> Any:
            return self.optimizer.defaults

        @defaults.setter
        def defaults(self, value: Any) -> None:
            self.optimizer.defaults = value

        def step(self, closure: Any = None) -> Any:
            return self._step(closure)

        def zero_grad(self, set_to_none: bool = True) -> None:
            if self._between_steps():
                self.optimizer.zero_grad(set_to_none=set_to_none)

        def state_dict(self) -> Any:
            return self.optimizer.state_dict()

        def load_state_dict(self, state_dict: Any) -> None:
            self.optimizer.load_state_dict(state_dict)

        def add_param_group(self, param_group: Any) -> None:
            self.optimizer.add_param_group(param_group)

        def __repr__(self) -> str:
            return f"AdoptedOptimizer({self.optimizer!r})"

    return AdoptedOptimizer


def batch_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> int | None:
    """The samples of a forward call: the first dimension of its first tensor argument
    (positional first, then keyword), None when it has none."""
    import torch

    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() > 0:
            return int(value.shape[0])
    return None
