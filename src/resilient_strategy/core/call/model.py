"""The model the user passed, read duck-typed (no torch or Keras import): the bytes of its
trainable parameters, its default sharding units (a transformer's repeated blocks) and the bytes
of the largest of them, for the memory check (`measures.memory`) and FSDP's wrapping
(``frameworks/fsdp.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ...errors import InvalidOptionError


def gradient_bytes_of(model: Any) -> int:
    """Bytes of trainable parameters of a torch module or a Keras model (duck-typed, no import)."""
    if hasattr(model, "parameters"):
        return sum(
            int(p.numel()) * int(p.element_size()) for p in model.parameters() if p.requires_grad
        )
    weights = getattr(model, "trainable_weights", None)
    if weights is not None:
        total = 0
        for w in weights:
            n = 1
            for d in w.shape:
                n *= int(d)
            total += n * int(getattr(getattr(w, "dtype", None), "size", 4) or 4)
        return total
    raise InvalidOptionError("model= must be a torch.nn.Module or a Keras model", "model")


def _param_bytes(module: Any, recurse: bool = True) -> int:
    return sum(int(p.numel()) * int(p.element_size()) for p in module.parameters(recurse=recurse))


def repeated_blocks(model: Any) -> list[Any]:
    """The default sharding units of a torch module: the children of one class under one parent,
    two or more of them, holding the most parameters of all such groups (a transformer's layers,
    not the two Linear layers that are its embedding and head; the Linear layers of an MLP), in
    order. Empty when nothing repeats."""
    best: list[Any] = []
    best_bytes = 0
    for parent in [model, *(m for m in model.modules() if m is not model)]:
        groups: dict[type, list[Any]] = {}
        for child in parent.children():
            groups.setdefault(type(child), []).append(child)
        for members in groups.values():
            if len(members) < 2:
                continue
            size = sum(_param_bytes(m) for m in members)
            if size > best_bytes:
                best, best_bytes = [m for m in members if _param_bytes(m)], size
    return best if len(best) >= 2 else []


def unit_bytes_of(model: Any, units: Iterable[Any] | None = None) -> int:
    """Parameter bytes of the largest sharding unit: each unit, and the root's parameters that no
    unit holds (the root is the last unit)."""
    blocks = list(repeated_blocks(model) if units is None else units)
    sizes = [_param_bytes(b) for b in blocks]
    return max([*sizes, _param_bytes(model) - sum(sizes)])
