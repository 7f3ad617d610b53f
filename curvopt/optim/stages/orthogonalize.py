"""``v ← √max(1, m/n) · polar(v)`` for every matrix-shaped parameter (``orthogonalize=True``):
the preconditioned (and momentum-averaged) update of a weight ``[m, n, *k]``, as the matrix
``[m, n·k]``, replaced by its orthogonal polar factor (:func:`~curvopt.optim.orthogonalized`,
Newton–Schulz, in the group's ``orthogonalize_dtype``), scaled as ``torch.optim.Muon``'s
``adjust_lr_fn="original"`` does. Vectors keep their update. With the identity as curvature
this is Muon's step; with Kronecker factors it is Kronecker preconditioning followed by
orthogonalisation.

``orthogonalize_dtype="auto"`` chooses the precision for the host: the first step that meets a
matrix of a new shape class (:func:`shape_class`: its device and its sides rounded up to powers
of two) times Newton–Schulz on it in each of :data:`AUTO_CANDIDATES`, interleaved
(:func:`faster_dtype`), and keeps the faster one in the state of every parameter of that class
(``state["orthogonalize_dtype"]``, a ``torch.dtype``): the measurement runs once per class
and optimizer, and a loaded ``state_dict`` keeps the choice. bfloat16 must be clearly faster
(:data:`BFLOAT16_MARGIN`): where the two are close, float32 is kept, so that a class near the
crossover does not change its precision from one process to the next with the timing noise.
"""

from __future__ import annotations

import statistics
import time

import torch

from curvopt.optim.options import AUTO_DTYPE, newton_schulz_dtype
from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.transforms import orthogonalized

#: the dtypes ``orthogonalize_dtype="auto"`` chooses from
AUTO_CANDIDATES = (torch.bfloat16, torch.float32)
#: bfloat16 is chosen only where its median time is at most float32's divided by this. On the
#: project's Intel host bfloat16 was 1.1-1.4x faster on the GPT's 384x128 and 128x512 updates,
#: which changed their choice between processes without a margin, and 2.7-4.3x from 256x256 on
BFLOAT16_MARGIN = 1.5


class Orthogonalize(Stage):
    order = 57
    identity_at = ("orthogonalize", False)

    def __call__(self, step: GroupStep) -> None:
        if not step.group["orthogonalize"]:
            return
        automatic = step.group["orthogonalize_dtype"] == AUTO_DTYPE
        fixed = None if automatic else newton_schulz_dtype(step.group["orthogonalize_dtype"])
        chosen = _chosen(step) if automatic else {}
        for item in step.params:
            direction = item.direction
            if direction is None or direction.dim() < 2:
                continue
            matrix = direction.reshape(direction.shape[0], -1)
            dtype = fixed
            if automatic:
                kind = shape_class(matrix)
                if kind not in chosen:
                    chosen[kind] = faster_dtype(matrix)
                dtype = chosen[kind]
                item.update.state["orthogonalize_dtype"] = dtype
            scale = max(1.0, matrix.shape[0] / matrix.shape[1]) ** 0.5
            polar = orthogonalized(matrix, dtype=dtype)
            item.direction = polar.mul_(scale).reshape(direction.shape)
            item.own = item.direction


def _chosen(step: GroupStep) -> dict[tuple, torch.dtype]:
    """The dtypes the group's parameters chose at earlier steps, by shape class."""
    chosen = {}
    for item in step.params:
        dtype, direction = item.state.get("orthogonalize_dtype"), item.direction
        if dtype is not None and direction is not None and direction.dim() >= 2:
            chosen[shape_class(direction.reshape(direction.shape[0], -1))] = dtype
    return chosen


def shape_class(matrix: torch.Tensor) -> tuple:
    """``(device, rows, cols)``, the sides of ``matrix`` rounded up to powers of two: matrices of
    one class cost about as much, and the faster dtype of one is that of the others."""
    rows, cols = matrix.shape
    return (str(matrix.device), 1 << (rows - 1).bit_length(), 1 << (cols - 1).bit_length())


def faster_dtype(matrix: torch.Tensor, rounds: int = 3) -> torch.dtype:
    """The dtype of :data:`AUTO_CANDIDATES` in which Newton–Schulz on ``matrix`` is faster: the
    median wall time of ``rounds`` interleaved runs each (after one warm-up run each; a CUDA
    device is synchronised around every run), bfloat16 only where it is at least
    :data:`BFLOAT16_MARGIN` times faster than float32.

    Args:
        matrix: ``[rows, cols]``, the update to orthogonalise.
        rounds: timed runs per dtype.

    Returns:
        ``torch.bfloat16`` or ``torch.float32``.

    Example:
        >>> faster_dtype(torch.ones(8, 4)) in AUTO_CANDIDATES
        True
    """
    times = {dtype: [] for dtype in AUTO_CANDIDATES}
    for round_ in range(rounds + 1):
        for dtype in AUTO_CANDIDATES:
            seconds = _timed(matrix, dtype)
            if round_:
                times[dtype].append(seconds)
    median = {dtype: statistics.median(seconds) for dtype, seconds in times.items()}
    faster = median[torch.bfloat16] * BFLOAT16_MARGIN <= median[torch.float32]
    return torch.bfloat16 if faster else torch.float32


def _timed(matrix: torch.Tensor, dtype: torch.dtype) -> float:
    """Seconds of one ``orthogonalized(matrix, dtype=dtype)``."""
    cuda = matrix.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(matrix.device)
    start = time.perf_counter()
    orthogonalized(matrix, dtype=dtype)
    if cuda:
        torch.cuda.synchronize(matrix.device)
    return time.perf_counter() - start
