"""Floors: an analytic lower bound of the *extra* work a quantity needs over the plain
forward+backward pass, in flops and bytes, per (problem, quantity) cell, and a floor time.

The model is walked once (:func:`structure`): a forward pass with hooks records, for every
``nn.Linear`` and ``nn.Conv2d`` with a parameter that requires grad, its input width ``I``
(``in_features``; ``C_in/groups · kh · kw`` for a conv: one patch), output width ``O``, positions
per sample ``P`` (1 for a plain Linear, ``T`` for a Linear on ``[N, T, I]``, ``H_out · W_out``
for a conv), whether its input needs a gradient (the first layer's does not: no data backward)
and whether it is *position-wise* towards the loss: the loss rows of a sample (``R`` rows of
``C`` classes each; ``R = T`` for a language model's flattened ``[N·T, V]`` logits, else 1)
each depend on the layer's output at one position only (tested by perturbing position 0 and
watching the other rows; a perturbation masked on its way, or a module called twice and counted
once, can only lower the count). Every other module (activations, pooling, LayerNorm, Embedding,
attention's softmax) is counted as free, so every floor stays a lower bound.

Per layer, with ``N`` samples and ``numel = O·I`` (+ ``O`` for a bias), the extra flops are
(a flop is a multiply or an add; a Gram ``Σ x xᵀ`` of ``m`` rows of width ``w`` costs
``m·w²``, its symmetric half):

* ``BatchGrad``: 0 flops (the per-sample products ``δ_n a_nᵀ`` cost what plain's weight
  gradient costs, and ``p.grad`` is their sum); bytes: ``grad_batch``, ``4·N·numel``.
* ``BatchL2Grad``: weight: ``P = 1``: ghost norms ``‖a_n‖²‖δ_n‖²``: ``2·N·(I+O) + N``;
  ``P > 1``: the cheaper of ghost norms ``N·P²·(I+O) + 2·N·P²`` (two Gram halves, their
  Frobenius product) and squaring per-sample gradients ``2·N·O·I``; bias: ``2·N·O`` after
  the per-sample sums ``N·P·O`` if ``P > 1``. Bytes: the norms, ``4·N`` per parameter.
* ``SumGradSquared``: ``2·N·numel`` (square and sum per-sample gradients, which replace
  plain's); ``Variance``: that plus ``3·numel``. Bytes: the result, ``4·numel``.
* Curvature from backpropagated columns: ``K`` columns per unit, ``U`` units of ``P'``
  positions each. ``DiagGGNMC`` and ``KFAC``: ``U = N``, ``K = 1``, ``P' = P``.
  ``DiagGGNExact``, ``DiagHessian``, ``KFLR``: the rank of each loss row's Hessian
  ``diag(p) − ppᵀ`` is ``C − 1``, so for a position-wise layer with ``P = R`` the units are
  the ``N·R`` rows, ``K = C − 1``, ``P' = 1``; for any other layer ``U = N``,
  ``K = R·(C−1)`` (a sample's rows mix below it, e.g. through attention), ``P' = P``. Then:

  - the columns' data backward, where the layer's input needs a gradient: ``2·U·K·P'·O·I``;
  - a diagonal (``DiagGGN*``, ``DiagHessian``): weight ``P' = 1``: ``2·U·O·I`` (one product
    of ``Σ_k δ²`` with ``a²``) ``+ 2·U·K·O + U·I``; ``P' > 1``: ``U·K·(2·P'·O·I + 2·O·I)``
    (per-column gradients, squared); bias: ``2·U·K·O`` (+ ``U·K·P'·O`` if ``P' > 1``);
  - Kronecker factors (``KFAC``, ``KFLR``): ``B``: ``U·K·P'·O²``, ``A``: ``N·P·I²``;
  - the exact loss-Hessian square root ``diag(√p) − p√pᵀ`` (``KFLR``, ``DiagGGNExact``,
    ``DiagHessian``): ``2·N·R·C·(C−1)`` once.

  ``DiagHessian`` counts as ``DiagGGNExact``: the residual terms of curved activations are not
  counted (they are zero for ReLU and max-pool). Bytes: the results (``4·numel`` for a
  diagonal; ``4·(O² + I²)`` for the factors) plus, for a conv's ``A``, its patches
  ``4·N·P·I`` (the unfolded input the Gram reads); columns can be processed in blocks, so they
  are not counted.
* ``KFRA`` (Linear chains): ``B`` of the top layer, the batch mean of ``diag(p) − ppᵀ``:
  ``N·R·C²``; each layer's ``A``: ``N·P·I²``; each lower layer's ``B = Wᵀ B W`` scaled by the
  mean of ``φ'φ'ᵀ``: ``2·O²·I + 2·O·I² + N·I²`` (the layer above's ``O`` and ``I``).
* ``GGN_matvec`` (``Jᵀ H J v``, timed against plain): its backward is plain's, its extra is
  the tangent forward ``W ȧ + Ẇ a``: ``2·N·P·O·I`` per product (one where the input has no
  tangent); bytes: the vector and the result, ``8·numel``.

The floor time is ``max(flops / F, bytes / B)`` (a roofline; the two can overlap), with ``F`` the
achieved GFLOP/s of a float32 matmul and ``B`` the bandwidth of a large copy, both measured in
this process at its thread count (:func:`calibrate`). ``measured/floor`` is curvopt's measured
extra time (its step minus the plain step, medians) over that floor time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
from torch import nn

from .backends import Instance
from .cases import QUANTITIES, Quantity
from .problems import Problem

F32 = 4  # bytes per float32


@dataclass(frozen=True)
class Layer:
    """One Linear/Conv2d layer with trainable parameters, as the problem runs it."""

    name: str
    inputs: int  # I: in_features, or C_in/groups · kh · kw (one patch)
    outputs: int  # O
    positions: int  # P per sample
    weight: bool  # the weight requires grad
    bias: bool  # there is a bias that requires grad
    data_backward: bool  # the layer's input requires grad (its input gradient is needed)
    positionwise: bool  # each loss row of a sample depends on one output position only
    conv: bool

    @property
    def numel(self) -> int:
        return self.outputs * self.inputs * self.weight + self.outputs * self.bias


@dataclass(frozen=True)
class Structure:
    """A problem's layers and loss shape: ``N`` samples, ``R`` loss rows of ``C`` classes each."""

    layers: tuple[Layer, ...]
    samples: int
    rows: int
    classes: int


@dataclass(frozen=True)
class Floor:
    problem: str
    quantity: str
    flops: float
    bytes: float

    def ms(self, calibration: Calibration) -> float:
        """The roofline time of the extra work, in milliseconds."""
        return 1e3 * max(self.flops / calibration.flops_per_s, self.bytes / calibration.bytes_per_s)


@dataclass(frozen=True)
class Calibration:
    flops_per_s: float
    bytes_per_s: float
    threads: int


def _positions(module: nn.Module, out: torch.Tensor, samples: int) -> int:
    if isinstance(module, nn.Conv2d):
        return out[0].numel() // out.shape[1]
    return out.numel() // (samples * out.shape[-1])


def _inputs(module: nn.Module) -> int:
    if isinstance(module, nn.Conv2d):
        return module.in_channels // module.groups * module.kernel_size[0] * module.kernel_size[1]
    return module.in_features


def _positionwise(model, X, module, rows: int, reference: torch.Tensor) -> bool:
    """Whether perturbing the layer's output at sample 0, position 0 leaves sample 0's other
    loss rows unchanged (always true with one row per sample)."""
    if rows == 1:
        return True

    def bump(_, __, out):
        out = out.clone()
        out.reshape(out.shape[0], -1, out.shape[-1])[0, 0] += 1.0
        return out

    handle = module.register_forward_hook(bump)
    try:
        with torch.no_grad():
            changed = model(X)[1:rows] - reference[1:rows]
    finally:
        handle.remove()
    return bool(changed.abs().max() == 0)


def structure(problem: Problem, linear_only: bool = False) -> Structure:
    """Walk ``problem``'s model: one forward pass records every Linear/Conv2d with trainable
    parameters (in execution order), then each layer is tested for position-wise-ness."""
    inst = Instance.of(problem, "cpu", linear_only)
    model, X = inst.model.eval(), inst.X
    seen: dict[nn.Module, tuple[str, int, bool]] = {}
    names = {m: n for n, m in model.named_modules()}

    def record(module, args, out):
        if module not in seen:
            seen[module] = (
                names[module],
                _positions(module, out, X.shape[0]),
                args[0].requires_grad,
            )

    handles = [
        m.register_forward_hook(record)
        for m in model.modules()
        if isinstance(m, (nn.Linear, nn.Conv2d)) and any(p.requires_grad for p in m.parameters())
    ]
    try:
        out = model(X)
    finally:
        for h in handles:
            h.remove()
    if out.dim() != 2 or out.shape[0] % X.shape[0]:
        raise ValueError(
            f"floors: problem {problem.name!r} outputs {tuple(out.shape)}; expected loss rows "
            f"[N·R, C] for N = {X.shape[0]} samples"
        )
    rows = out.shape[0] // X.shape[0]
    layers = []
    for module, (name, positions, data) in seen.items():
        conv = isinstance(module, nn.Conv2d)
        bias = module.bias is not None and module.bias.requires_grad
        layers.append(
            Layer(
                name,
                _inputs(module),
                module.out_channels if conv else module.out_features,
                positions,
                module.weight.requires_grad,
                bias,
                data,
                positions == rows and _positionwise(model, X, module, rows, out.detach()),
                conv,
            )
        )
    return Structure(tuple(layers), X.shape[0], rows, out.shape[1])


def _units(s: Structure, layer: Layer, exact: bool) -> tuple[int, int, int]:
    """``(U, K, P')``: units, columns per unit and positions per unit of the backpropagated
    columns (module docstring)."""
    if not exact:
        return s.samples, 1, layer.positions
    if layer.positionwise and s.rows > 1:
        return s.samples * s.rows, s.classes - 1, 1
    return s.samples, s.rows * (s.classes - 1), layer.positions


def _diagonal(layer: Layer, U: int, K: int, P: int) -> float:
    din, dout = layer.inputs, layer.outputs
    flops = 0.0
    if layer.weight:
        flops += (
            2 * U * dout * din + 2 * U * K * dout + U * din
            if P == 1
            else U * K * (2 * P * dout * din + 2 * dout * din)
        )
    if layer.bias:
        flops += 2 * U * K * dout + (U * K * P * dout if P > 1 else 0)
    return flops


def _columns_backward(layer: Layer, U: int, K: int, P: int) -> float:
    return 2 * U * K * P * layer.outputs * layer.inputs if layer.data_backward else 0.0


def _batch_l2(layer: Layer, N: int) -> float:
    din, dout, P = layer.inputs, layer.outputs, layer.positions
    flops = 0.0
    if layer.weight:
        if P == 1:
            flops += 2 * N * (din + dout) + N
        else:
            flops += min(N * P * P * (din + dout) + 2 * N * P * P, 2 * N * dout * din)
    if layer.bias:
        flops += 2 * N * dout + (N * P * dout if P > 1 else 0)
    return flops


def _kfra(s: Structure) -> float:
    flops = s.samples * s.rows * s.classes**2
    layers = s.layers
    for layer in layers:
        if layer.positions != 1 or layer.conv:
            raise ValueError(f"floors: KFRA is counted for Linear chains only, not {layer.name}")
    for above in layers[1:]:
        din, dout = above.inputs, above.outputs
        flops += 2 * dout * dout * din + 2 * dout * din * din + s.samples * din * din
    return flops + sum(s.samples * layer.positions * layer.inputs**2 for layer in layers)


def floor(problem: Problem, quantity: Quantity | str, s: Structure | None = None) -> Floor:
    """The extra flops and bytes of ``quantity`` on ``problem`` over the plain step."""
    quantity = QUANTITIES[quantity] if isinstance(quantity, str) else quantity
    s = s or structure(problem, quantity.linear_only)
    q, N = quantity.name.removesuffix("_linear"), s.samples
    numel = sum(layer.numel for layer in s.layers)
    flops, nbytes = 0.0, 0.0
    sqrt = 2 * N * s.rows * s.classes * (s.classes - 1)
    if q == "BatchGrad":
        nbytes = F32 * N * numel
    elif q == "BatchL2Grad":
        flops = sum(_batch_l2(layer, N) for layer in s.layers)
        nbytes = F32 * N * sum(layer.weight + layer.bias for layer in s.layers)
    elif q in ("SumGradSquared", "Variance"):
        flops = 2 * N * numel + (3 * numel if q == "Variance" else 0)
        nbytes = F32 * numel
    elif q in ("DiagGGNMC", "DiagGGNExact", "DiagHessian"):
        exact = q != "DiagGGNMC"
        for layer in s.layers:
            U, K, P = _units(s, layer, exact)
            flops += _columns_backward(layer, U, K, P) + _diagonal(layer, U, K, P)
        flops += sqrt if exact else 0
        nbytes = F32 * numel
    elif q in ("KFAC", "KFLR"):
        exact = q == "KFLR"
        for layer in s.layers:
            U, K, P = _units(s, layer, exact)
            flops += _columns_backward(layer, U, K, P) + U * K * P * layer.outputs**2
            nbytes += F32 * layer.outputs**2
            if layer.weight:
                flops += N * layer.positions * layer.inputs**2
                nbytes += F32 * (
                    layer.inputs**2 + (N * layer.positions * layer.inputs if layer.conv else 0)
                )
        flops += sqrt if exact else 0
    elif q == "KFRA":
        flops = _kfra(s)
        nbytes = F32 * sum(layer.outputs**2 + layer.inputs**2 for layer in s.layers)
    elif q == "GGN_matvec":
        flops = sum(
            2 * N * layer.positions * layer.outputs * layer.inputs * (1 + layer.data_backward)
            for layer in s.layers
        )
        nbytes = 2 * F32 * numel
    else:
        raise ValueError(f"floors: no floor for quantity {quantity.name!r}")
    return Floor(problem.name, quantity.name, float(flops), float(nbytes))


def extra_ms(result) -> float | None:
    """Median over rounds of a timing result's step time minus the plain step's (ms)."""
    if result is None or not result.ratios:
        return None
    return 1e3 * statistics.median(t - t / r for t, r in zip(result.times, result.ratios))


def _best(run, reps: int) -> float:
    run()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def calibrate(size: int = 512, megabytes: int = 64, reps: int = 5) -> Calibration:
    """Achieved float32 matmul FLOP/s (``size``³ sgemm, ``2·size³`` flops) and copy bandwidth
    (``megabytes`` read plus as many written) at ``torch.get_num_threads()``, best of ``reps``."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    c = torch.empty(size, size)
    gemm = _best(lambda: torch.mm(a, b, out=c), reps)
    src = torch.empty(megabytes * 2**20 // F32).uniform_()
    dst = torch.empty_like(src)
    copy = _best(lambda: dst.copy_(src), reps)
    return Calibration(2 * size**3 / gemm, 2 * src.numel() * F32 / copy, torch.get_num_threads())
