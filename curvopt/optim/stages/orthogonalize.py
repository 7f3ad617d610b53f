"""``v ← √max(1, m/n) · polar(v)`` for every matrix-shaped parameter (``orthogonalize=True``):
the preconditioned (and momentum-averaged) update of a weight ``[m, n, *k]``, as the matrix
``[m, n·k]``, replaced by its orthogonal polar factor (:func:`~curvopt.optim.orthogonalized`,
Newton–Schulz, in the group's ``orthogonalize_dtype``), scaled as ``torch.optim.Muon``'s
``adjust_lr_fn="original"`` does. Vectors keep their update. With the identity as curvature
this is Muon's step; with Kronecker factors it is Kronecker preconditioning followed by
orthogonalisation."""

from __future__ import annotations

from curvopt.optim.options import newton_schulz_dtype
from curvopt.optim.stages.base import GroupStep, Stage
from curvopt.optim.transforms import orthogonalized


class Orthogonalize(Stage):
    order = 57
    identity_at = ("orthogonalize", False)

    def __call__(self, step: GroupStep) -> None:
        if not step.group["orthogonalize"]:
            return
        dtype = newton_schulz_dtype(step.group["orthogonalize_dtype"])
        for item in step.params:
            direction = item.direction
            if direction is None or direction.dim() < 2:
                continue
            matrix = direction.reshape(direction.shape[0], -1)
            scale = max(1.0, matrix.shape[0] / matrix.shape[1]) ** 0.5
            polar = orthogonalized(matrix, dtype=dtype)
            item.direction = polar.mul_(scale).reshape(direction.shape)
            item.own = item.direction
