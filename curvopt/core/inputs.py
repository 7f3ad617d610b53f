"""Model inputs and outputs as ``verify`` and ``linalg`` handle them (Hugging Face style too).

* inputs: a tensor (``model(x)``), a tuple or list (``model(*inputs)``) or a mapping
  (``model(**inputs)``, e.g. ``{"input_ids": ids, "attention_mask": mask}``);
* outputs: ``output=None`` takes a tensor as it is and the ``.logits`` of a ``ModelOutput``
  (a dict subclass or dataclass) or a mapping's ``"logits"``; ``output="name"`` takes that
  attribute or key; a callable ``output(out)`` returns the tensor the loss is computed on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Callable, Optional, Union

import torch

Selector = Optional[Union[str, Callable[[Any], torch.Tensor]]]


def split(inputs) -> tuple[tuple, dict]:
    """``(args, kwargs)`` to call the model with."""
    if isinstance(inputs, Mapping):
        return (), dict(inputs)
    if isinstance(inputs, (tuple, list)):
        return tuple(inputs), {}
    return (inputs,), {}


def call(model, inputs):
    """``model`` applied to ``inputs`` (see module docstring)."""
    args, kwargs = split(inputs)
    return model(*args, **kwargs)


def select(out, output: Selector = None) -> torch.Tensor:
    """The tensor of the model output ``out`` that the loss takes (see module docstring)."""
    if callable(output):
        return output(out)
    if output is None:
        if isinstance(out, torch.Tensor):
            return out
        output = "logits"
    value = out.get(output) if isinstance(out, Mapping) else getattr(out, output, None)
    if not isinstance(value, torch.Tensor):
        raise TypeError(
            f"curvopt: cannot find the tensor {output!r} in the model output "
            f"({type(out).__name__}). Pass output='<attribute or key>' or a callable returning "
            "the tensor the loss is computed on, output=lambda out: out.logits."
        )
    return value


def apply(fn, inputs):
    """``inputs`` with ``fn`` applied to every tensor (same container type)."""
    if isinstance(inputs, torch.Tensor):
        return fn(inputs)
    if isinstance(inputs, Mapping):
        return {k: apply(fn, v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(apply(fn, v) for v in inputs)
    return inputs


def first_tensor(inputs) -> torch.Tensor:
    """The first tensor of ``inputs`` (depth first), which fixes the batch size."""
    if isinstance(inputs, torch.Tensor):
        return inputs
    values = inputs.values() if isinstance(inputs, Mapping) else inputs
    for value in values if isinstance(inputs, (Mapping, tuple, list)) else ():
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def sample(inputs, dim: int, n: int, i: int):
    """Sample ``i`` of ``inputs``: every tensor with ``n`` entries along ``dim`` narrowed to
    ``i:i+1`` there, other values (shared masks, flags) whole."""

    def cut(x):
        return x.narrow(dim, i, 1) if x.dim() > dim and x.shape[dim] == n else x

    return apply(cut, inputs)
