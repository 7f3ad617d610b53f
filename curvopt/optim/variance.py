"""``VarianceAdaptedSGD``: element-wise variance adaptation (M-SVAG, Balles & Hennig 2018)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

import torch

from curvopt.optim.base import CurvatureOptimizer
from curvopt.optim.options import CurvatureOptions, number, option
from curvopt.optim.plan import ParamUpdate
from curvopt.optim.transforms import add_weight_decay


@dataclass(frozen=True)
class VarianceAdaptedOptions(CurvatureOptions):
    """``lr``, ``weight_decay`` and the momentum ``β ∈ [0, 1)`` of M-SVAG."""

    POSITIONAL: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay")

    momentum: float = option(0.0, number(0.0, 1.0, open_high=True))


class VarianceAdaptedSGD(CurvatureOptimizer):
    """SGD whose step is shrunk element-wise where the gradient is noisy.

    With ``g = ∇L + δ θ``, the exact mini-batch variance ``σ² = p.variance`` of the
    per-sample gradients (``Variance()``) and the batch size ``N`` (from ``BatchL2Grad()``),
    the variance of the mini-batch gradient is estimated (for either loss reduction) as
    ``s = N² / (N − 1) · σ²`` (0 when ``N = 1``). At step ``t = 1, 2, ...``, with momentum ``β``::

        m̃ ← β m̃ + (1 − β) g,     m = m̃ / (1 − βᵗ)                 (bias-corrected mean)
        ρ = (1 − β)(1 + βᵗ) / ((1 + β)(1 − βᵗ))                     (variance factor of m)
        γ = m² / (m² + ρ s)       (γ = 1 where m² + ρ s = 0)
        θ ← θ − lr · γ ⊙ m

    With ``β = 0`` (default) this is SVAG, ``θ ← θ − lr · g²/(g² + s) ⊙ g``; with ``β > 0`` it
    is M-SVAG. When all per-sample gradients agree, ``s = 0`` and ``γ = 1``: the step is SGD's
    (``torch.optim.SGD(lr)`` for ``β = 0``, SGD on the bias-corrected average ``m`` otherwise).

    Under ``torch.distributed`` (a ``DistributedDataParallel`` model, ``process_group=`` as for
    ``KFAC``) the variance is that of all ranks' samples, as one process on their concatenated
    batch would find it: with ``K`` ranks of ``n`` samples each (``N = K n``), the per-sample
    gradients of DDP's objective (the ranks' mean loss) are the ranks' own ``g_n / K``, so
    ``σ² = (1/N) Σ_n (g_n / K)² − (ḡ / N)²`` with ``Σ_n g_n²`` the rank average of each rank's
    ``p.sum_grad_squared`` times ``K`` (``SumGradSquared()`` replaces ``Variance()`` there) and
    ``ḡ`` the gradient DDP averaged. The gradients the backward passes left are averaged too
    (as DDP averages them, a second all-reduce of the gradient's size) to recognise a rescaled
    gradient. All ranks need shards of the same size (else the averaging raises). Under FSDP2
    (``fully_shard``) each rank steps its rows: its rows of the averaged ``Σ g²``, of FSDP2's
    averaged gradient (seen after its reduce-scatter, so not averaged again) and of
    ``exp_avg``.

    A gradient rescaled between the backward pass and ``step`` (``clip_grad_norm_``:
    ``p.grad = c · Σ_n g_n``) is the sum of the rescaled per-sample gradients ``c g_n``, whose
    variance is ``c² s``: the step uses that (:func:`rescaling`). A gradient changed otherwise
    (``clip_grad_value_``, adding to ``p.grad``) raises, since its variance is unknown.

    Args:
        params: parameters or param groups, as for ``torch.optim.SGD``.
        lr: learning rate ``≥ 0``; SVAG shrinks the steps, so it usually takes a larger
            ``lr`` than SGD.
        momentum: ``β ∈ [0, 1)``.
        weight_decay: ``δ ≥ 0`` (added to the gradient; it has no variance).
        collection: ``"auto"`` (default: collect what the next step needs on every backward
            pass that reaches the optimizer's parameters) or ``"explicit"`` (only inside
            ``opt.collect()`` or ``opt.step(closure)``).

    Raises:
        ValueError: (at construction) negative ``lr`` or ``weight_decay``, or ``momentum``
            outside ``[0, 1)``.
        RuntimeError: (at ``step``) ``p.grad`` was changed other than by a rescaling
            between the backward pass and the step, so that its variance is unknown.

    Example:
        >>> import torch, curvopt
        >>> _ = torch.manual_seed(0)
        >>> model = curvopt.extend(torch.nn.Sequential(torch.nn.Linear(3, 2)))
        >>> lossfunc = torch.nn.CrossEntropyLoss()  # extended or not
        >>> X, y = torch.randn(16, 3), torch.randint(0, 2, (16,))
        >>> opt = curvopt.optim.VarianceAdaptedSGD(model.parameters(), lr=0.1)
        >>> before = lossfunc(model(X), y).item()
        >>> for _ in range(5):
        ...     opt.zero_grad()
        ...     lossfunc(model(X), y).backward()  # the optimizer collects what it needs
        ...     opt.step()
        >>> lossfunc(model(X), y).item() < before
        True
    """

    Options = VarianceAdaptedOptions
    _distributable = True

    def add_param_group(self, param_group):
        """As in ``torch.optim``; also remembers each new parameter's gradient as the backward
        pass leaves it (to recognise a rescaled gradient at the step)."""
        super().add_param_group(param_group)
        self.__dict__.setdefault("_collected", {})
        self.__dict__.setdefault("_hooks", {})
        for param in self.param_groups[-1]["params"]:
            self._watch(param)

    def _watch(self, param: torch.Tensor) -> None:
        if param in self._hooks or not param.requires_grad:
            return
        owner = weakref.ref(self)

        def remember(p):
            optimizer = owner()
            if optimizer is not None and p.grad is not None:
                grad = p.grad
                optimizer._collected[p] = (grad.detach().clone(), weakref.ref(grad), grad._version)

        self._hooks[param] = param.register_post_accumulate_grad_hook(remember)

    def _moment(self) -> tuple[str, str]:
        """The attribute (and its extension) the variance comes from: ``variance`` in one
        process, ``sum_grad_squared`` under ``torch.distributed`` (it adds over ranks)."""
        if self._distributed is None:
            return "variance", "Variance"
        return "sum_grad_squared", "SumGradSquared"

    def _sharded_layout(self) -> str:
        """Under FSDP2 each rank steps its rows (the step is element-wise): its rows of the
        averaged ``Σ g²``, of FSDP2's averaged gradient and of ``exp_avg``."""
        return "rows"

    def _needs(self, group, group_state):
        return [(self._moment()[0], {}), ("batch_l2", {})]

    def _plan_group(self, group, group_state, with_model):
        beta = group["momentum"]
        updates = []
        attr, extension = self._moment()
        unused = self._unused(group["params"], (attr, "batch_l2"))
        seen = self._seen([p for p in group["params"] if id(p) not in unused])
        for index, param in enumerate(group["params"]):
            if id(param) in unused:
                continue
            state = self.state.get(param, {})
            update = ParamUpdate(param, self._describe(group, index, param))
            moment = self._view.rows_of(param, self._read(update, attr, extension, None))
            batch_l2 = self._read(update, "batch_l2", "BatchL2Grad", None)
            update.checks += [("gradient", param.grad), (f"`{attr}`", moment)]
            collected, slack = seen.get(param, (None, 0.0))
            variance, n = self._variance(moment, batch_l2.shape[0], param, collected)
            divided = self._loss_scale.divided_already  # by scaler.unscale_, in place
            scale = rescaling(param.grad, collected, update.description, divided, slack)
            noise = variance * (scale * n * n / (n - 1)) if n > 1 else torch.zeros_like(variance)

            grad = add_weight_decay(self._grad(param), param, group["weight_decay"])
            t = state.get("step", 0) + 1
            average = grad * (1 - beta) if t == 1 else torch.lerp(grad, state["exp_avg"], beta)
            mean = average / (1 - beta**t)
            rho = (1 - beta) * (1 + beta**t) / ((1 + beta) * (1 - beta**t))
            signal = mean * mean
            total = signal + rho * noise
            gain = torch.where(total > 0, signal / torch.where(total > 0, total, 1), 1)
            update.delta = group["lr"] * gain * mean
            update.checks.append(("update", update.delta))
            if beta > 0:
                update.state = {"step": t, "exp_avg": average}
            updates.append(update)
        return updates, 0.0

    def _seen(self, params) -> dict:
        """Per parameter the gradient its backward passes left (``rescaling``'s ``collected``)
        and the rounding allowed when comparing it with ``p.grad`` (``slack``). Under
        ``torch.distributed``: the rank averages of the ranks' own gradients (in one all-reduce
        with their absolute values): DDP's gradient up to the order of the sums, whose rounding
        is at most ``2 K ε`` times the average of the absolute values."""
        seen, rows = {}, {}
        for p in params:
            found = self._collected.get(self._view.sharded(p))
            if found is not None and self._view.rows(p) is not None:  # FSDP2: averaged already
                copy, written, version = found
                rows[p] = ((copy.to_local(), written, version), 0.0)
            elif found is not None:
                seen[p] = found
        if self._distributed is None or not seen:
            return {**rows, **{p: (c, 0.0) for p, c in seen.items()}}
        copies = [c[0] for c in seen.values()]
        averages = self._distributed.average(copies + [c.abs() for c in copies])
        world, count = self._distributed.world_size, len(copies)
        result = {}
        for i, (param, (_, written, version)) in enumerate(seen.items()):
            mean, size = averages[i], averages[count + i]
            eps = torch.finfo(mean.dtype).eps if mean.dtype.is_floating_point else 0.0
            result[param] = ((mean, written, version), size * (2 * world * eps))
        return {**rows, **result}

    def _variance(self, moment, n: int, param, collected) -> tuple[torch.Tensor, int]:
        """``(σ², N)``: the variance of ``param``'s per-sample gradients and their number. In
        one process ``moment`` is ``p.variance`` over the ``n`` samples; under
        ``torch.distributed`` it is the rank average of ``Σ g²`` over each rank's ``n``, and
        ``σ² = (Σ_n (g_n / K)²) / N − (ḡ / N)²`` over all ``N = K n`` samples, ``ḡ`` the
        averaged gradient of the backward passes (``collected``; ``p.grad`` where none was
        seen), without loss scale."""
        if self._distributed is None:
            return moment, n
        world = self._distributed.world_size
        count = n * world
        if collected is None:
            grad = self._grad(param)
        else:
            grad = collected[0] / (self._loss_scale.values or 1.0)
        mean = grad / count
        return (moment / world / count).sub_(mean * mean), count

    def step(self, closure=None):
        """As :meth:`CurvatureOptimizer.step`; the remembered gradients are dropped after."""
        try:
            return super().step(closure)
        finally:
            self._collected.clear()

    def __setstate__(self, state):
        super().__setstate__(state)
        self._collected, self._hooks = {}, {}
        for group in self.param_groups:
            for param in group["params"]:
                self._watch(param)


def rescaling(
    grad: torch.Tensor, collected, description: str, divided: float = 1.0, slack=0.0
) -> float:
    """``c²`` for ``grad = c · g₀``, ``g₀`` the gradient the backward pass left (``collected``:
    its copy, a weak reference to the tensor it was written to, and that tensor's version)
    divided by ``divided`` (a ``GradScaler``'s scale after ``unscale_``, which divides in place
    without a new version).

    ``c² = 1`` when ``grad`` is that very tensor, unchanged (or no backward pass was seen).
    Otherwise ``c = ⟨grad, g₀⟩ / ‖g₀‖²`` (in float64), and ``grad`` must equal ``c g₀`` up to the
    rounding of one product per entry and ``|c|`` times ``slack`` (per entry: the rounding by
    which ``g₀`` may differ from the gradient as it was written, e.g. a rank average summed in
    another order), ``|grad − c g₀| ≤ 8 ε (|grad| + |c g₀|) + |c| slack``; else
    ``RuntimeError``: the gradient was changed other than by a common factor.
    """
    if collected is None:
        return 1.0
    copy, written, version = collected
    unchanged = (written() is grad and grad._version == version) or torch.equal(grad, copy)
    if unchanged and divided == 1.0:
        return 1.0
    new, old = grad.detach().double(), copy.double() / divided
    norm = float((old * old).sum())
    scale = float((new * old).sum()) / norm if norm > 0 else 1.0
    eps = torch.finfo(grad.dtype).eps if grad.dtype.is_floating_point else 0.0
    residual = (new - scale * old).abs()
    bound = 8 * eps * (new.abs() + abs(scale) * old.abs())
    if isinstance(slack, torch.Tensor):
        bound = bound + abs(scale) * (slack.double() / divided)
    if not bool((residual <= bound).all()) and bool(new.isfinite().all()):
        raise RuntimeError(
            f"VarianceAdaptedSGD: the gradient of {description} was changed after the backward "
            "pass other than by a common factor (e.g. by clip_grad_value_, or by adding to "
            "p.grad), so the variance the pass collected is not that of this gradient. Rescale "
            "gradients only as a whole (clip_grad_norm_ is supported), or add terms such as "
            "weight decay through the optimizer's weight_decay."
        )
    return scale * scale
