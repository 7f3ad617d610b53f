"""Quantities written by ``curvopt.collect``, one backward pass per batch, leaving no trace.

Each pass runs ``lossfunc(model(inputs), targets).backward()`` inside ``collect(extension)``;
the parameters' ``.grad`` and any earlier value of the written attribute are restored
afterwards. Monte-Carlo extensions draw from a generator seeded with ``seed``; the global RNG
state is left as it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from curvopt.core import inputs as io
from curvopt.frontend.collect import collect
from curvopt.errors import UnsupportedModuleError
from curvopt.extensions.base import Extension
from curvopt.linalg.base import CurvatureOperator
from curvopt.core.values import read

_MISSING = object()


@contextlib.contextmanager
def _preserved(params: list[torch.Tensor], attr: str):
    saved = [(p.grad, p.__dict__.get(attr, _MISSING)) for p in params]
    try:
        yield
    finally:
        for p, (gradient, value) in zip(params, saved):
            p.grad = gradient
            if value is _MISSING:
                p.__dict__.pop(attr, None)
            else:
                setattr(p, attr, value)


def collected(
    op: CurvatureOperator, extension: Extension, seed: int
) -> Iterator[tuple[int, float, list]]:
    """``(R_b, D_b, [p.<extension.attr> per trainable parameter])`` for every batch of
    ``op.data``: its rows (dim 0 of the loss input), its weight ``op.weight`` and the values."""
    devices = [op.device] if op.device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices), _preserved(op.params, extension.attr):
        torch.manual_seed(seed)
        for inputs, targets in op.batches():
            for p in op.params:
                p.grad = None
                p.__dict__.pop(extension.attr, None)
            output = io.select(io.call(op.model, inputs), op.output)
            loss = op.lossfunc(output, targets)
            with collect(extension):
                loss.backward()
            values = [read(p, extension.attr) for p in op.params]
            missing = [n for n, v in zip(op.names, values) if v is None]
            if missing:
                raise UnsupportedModuleError(
                    f"curvopt.linalg: {type(extension).__name__} wrote nothing for parameters "
                    f"{missing[:3]}: they are not used by the loss or not owned by an extended "
                    "module; extend the whole model (curvopt.extend(model)) and freeze unused "
                    "parameters (requires_grad=False)"
                )
            yield output.shape[0], op.weight(output.detach(), targets), values
