"""Shared test helpers: independent per-sample references and a runner for curvopt.

The references never touch curvopt: they run on a *plain* deep copy of the model (taken before
``curvopt.extend``) through ``torch.func.functional_call``.

* :func:`per_sample_grads_loop`: every sample gets its own leaf copy of the parameters; the
  batch output is assembled from per-sample forwards and the *original* loss (any reduction)
  is differentiated with ``torch.autograd.grad`` w.r.t. each copy.  ``g_n`` is then exactly the
  gradient of the loss as the loss computes it, restricted to sample ``n``.
* :func:`per_sample_grads_vmap`: ``vmap(grad(...))`` of the single-sample loss, rescaled by
  ``1/N`` for ``reduction="mean"`` (valid for losses whose mean divides uniformly, e.g.
  unweighted cross-entropy and MSE).
"""

from __future__ import annotations

import copy
import gc
import weakref
from typing import Callable, Dict, Sequence, Tuple, Union

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap

import curvopt
from curvopt import extensions as ext
from curvopt.core.state import STATE
from curvopt.inversion import factor_inverse

torch.set_num_threads(1)

DT = torch.float64
Inputs = Union[torch.Tensor, Tuple]

#: first-order attribute -> extension class
FIRST_ORDER = {
    "grad_batch": ext.BatchGrad,
    "batch_l2": ext.BatchL2Grad,
    "sum_grad_squared": ext.SumGradSquared,
    "variance": ext.Variance,
}


# ------------------------------------------------------------------------------ model handling


class Conv1D(nn.Module):
    """The layout of Hugging Face's ``Conv1D`` (matched by class name): ``y = x W + b``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf))
        self.bias = nn.Parameter(torch.randn(nf))

    def forward(self, x):
        return (x.reshape(-1, x.shape[-1]) @ self.weight + self.bias).reshape(
            *x.shape[:-1], self.nf
        )


def extended_copy(model: nn.Module) -> nn.Module:
    """A deep copy of the *plain* ``model`` with curvopt's hooks installed."""
    return curvopt.extend(copy.deepcopy(model))


def trainable(model: nn.Module) -> Dict[str, nn.Parameter]:
    """``name -> parameter`` for parameters requiring grad (tied parameters listed once)."""
    return {k: p for k, p in model.named_parameters() if p.requires_grad}


def _as_tuple(inputs: Inputs) -> Tuple:
    return inputs if isinstance(inputs, tuple) else (inputs,)


def _dims(inputs: Tuple, in_dim) -> Tuple[int, ...]:
    return tuple(in_dim) if isinstance(in_dim, (tuple, list)) else (in_dim,) * len(inputs)


def _split(inputs: Tuple, n: int, dims: Tuple[int, ...], i: int) -> Tuple:
    """Sample ``i`` of every tensor input (along its batch dim; ``None``: passed whole)."""
    return tuple(
        x.narrow(d, i, 1) if isinstance(x, torch.Tensor) and d is not None else x
        for x, d in zip(inputs, dims)
    )


def batch_size(inputs: Inputs, dim: int = 0) -> int:
    return _as_tuple(inputs)[0].shape[dim]


# ------------------------------------------------------------------------------ references


def per_sample_grads_loop(
    model: nn.Module,
    loss_fn: Callable,
    inputs: Inputs,
    target,
    in_dim=0,
    out_dim: int = 0,
) -> Dict[str, torch.Tensor]:
    """``name -> [N, *p.shape]`` from per-sample parameter copies (see module docstring).

    Tensor ``inputs`` are split along ``in_dim`` (an int, or one per input, ``None`` for an
    input passed whole), the per-sample outputs are concatenated along ``out_dim`` and fed to
    ``loss_fn(output, target)``.
    """
    inputs = _as_tuple(inputs)
    dims = _dims(inputs, in_dim)
    n = inputs[0].shape[dims[0]]
    names = list(trainable(model))
    params = trainable(model)
    copies = [{k: params[k].detach().clone().requires_grad_() for k in names} for _ in range(n)]
    outs = []
    for i in range(n):
        outs.append(functional_call(model, copies[i], _split(inputs, n, dims, i)))
    loss = loss_fn(torch.cat(outs, dim=out_dim), target)
    flat = torch.autograd.grad(loss, [c[k] for c in copies for k in names], allow_unused=True)
    result = {}
    for j, k in enumerate(names):
        per = [flat[i * len(names) + j] for i in range(n)]
        per = [torch.zeros_like(params[k]) if g is None else g for g in per]
        result[k] = torch.stack(per)
    return result


def per_sample_grads_vmap(
    model: nn.Module, loss_fn: nn.Module, x: torch.Tensor, target: torch.Tensor
) -> Dict[str, torch.Tensor]:
    """``name -> [N, *p.shape]`` via ``vmap(grad(single-sample loss))``, batch dim 0."""
    params = {k: p.detach() for k, p in trainable(model).items()}
    n = x.shape[0]
    scale = 1.0 / n if getattr(loss_fn, "reduction", "sum") == "mean" else 1.0

    def one(p, xi, yi):
        return loss_fn(functional_call(model, p, (xi.unsqueeze(0),)), yi.unsqueeze(0)) * scale

    return vmap(grad(one), in_dims=(None, 0, 0))(params, x, target)


def reduce_reference(grad_batch: torch.Tensor) -> Dict[str, torch.Tensor]:
    """All first-order quantities (docs/conventions.md) from per-sample gradients."""
    return {
        "grad_batch": grad_batch,
        "batch_l2": (grad_batch**2).reshape(len(grad_batch), -1).sum(1),
        "sum_grad_squared": (grad_batch**2).sum(0),
        "variance": (grad_batch**2).mean(0) - grad_batch.mean(0) ** 2,
    }


# ------------------------------------------------------------------------------ curvopt side


def clear_attributes(model: nn.Module, attrs: Sequence[str] = tuple(FIRST_ORDER)) -> None:
    for p in model.parameters():
        p.grad = None
        for a in attrs:
            p.__dict__.pop(a, None)


def run_collect(
    model: nn.Module,
    lossfunc: Callable,
    inputs: Inputs,
    target,
    attrs: Sequence[str] = tuple(FIRST_ORDER),
    clear: bool = True,
) -> torch.Tensor:
    """Clear old results (only ``p.grad`` with ``clear=False``), forward, ``backward`` inside
    ``collect`` of the extensions for ``attrs``."""
    clear_attributes(model, FIRST_ORDER if clear else ())
    out = model(*_as_tuple(inputs))
    loss = lossfunc(out, target)
    with curvopt.collect(*(FIRST_ORDER[a]() for a in attrs)):
        loss.backward()
    return loss


def assert_close(actual, expected, what=""):
    """float64 comparison with an absolute floor relative to the size of ``expected``."""
    assert actual is not None, f"{what}: missing"
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    scale = expected.abs().max().item() if expected.numel() else 0.0
    atol = 1e-10 * max(scale, 1e-30) + 1e-13
    torch.testing.assert_close(actual, expected, rtol=1e-7, atol=atol, msg=lambda m: f"{what}: {m}")


def assert_first_order(
    model: nn.Module,
    reference: Dict[str, torch.Tensor],
    attrs: Sequence[str] = tuple(FIRST_ORDER),
    check_grad: bool = True,
) -> None:
    """Every trainable parameter of ``model`` carries ``attrs`` equal to the reference; frozen
    parameters carry none; ``p.grad == grad_batch.sum(0)``."""
    params = dict(model.named_parameters())
    assert set(reference) == set(trainable(model)), "reference/model parameter names differ"
    for name, p in params.items():
        if not p.requires_grad:
            for a in FIRST_ORDER:
                assert not hasattr(p, a), f"frozen {name} got {a}"
            continue
        expected = reduce_reference(reference[name])
        for a in attrs:
            assert_close(getattr(p, a, None), expected[a], f"{name}.{a}")
        if check_grad and p.grad is None:  # unused in the loss: zero per-sample gradients
            assert reference[name].abs().max() == 0, f"{name}.grad missing"
        elif check_grad:
            assert_close(p.grad, reference[name].sum(0), f"{name}.grad")
        if "grad_batch" in attrs and p.grad is not None:
            assert_close(p.grad_batch.sum(0), p.grad, f"{name}.grad_batch.sum(0) vs grad")
        for a in set(FIRST_ORDER) - set(attrs):
            assert not hasattr(p, a), f"{name} got {a} that was not requested"


#: the attribute sets every case runs: all four (per-sample gradients materialised) and the
#: reduced ones without BatchGrad (the rules' fast paths and the chunked fallback)
ATTR_SETS = [tuple(FIRST_ORDER), ("batch_l2", "sum_grad_squared", "variance")]


def check_against_loop(
    plain: nn.Module,
    lossfunc: Callable,
    inputs: Inputs,
    target,
    in_dim=0,
    out_dim: int = 0,
    attr_sets=ATTR_SETS,
    model: nn.Module = None,
):
    """Compare curvopt on an extended copy of ``plain`` with :func:`per_sample_grads_loop`."""
    reference = per_sample_grads_loop(plain, lossfunc, inputs, target, in_dim, out_dim)
    model = extended_copy(plain) if model is None else model
    ext_loss = lossfunc
    if isinstance(lossfunc, nn.Module):
        ext_loss = curvopt.extend(copy.deepcopy(lossfunc))
    for attrs in attr_sets:
        run_collect(model, ext_loss, inputs, target, attrs)
        assert_first_order(model, reference, attrs)
        if "grad_batch" in attrs:  # again, writing into the previous pass's (private) buffers
            run_collect(model, ext_loss, inputs, target, attrs, clear=False)
            assert_first_order(model, reference, attrs)
    return model, reference


@pytest.fixture
def seed():
    torch.manual_seed(0)
    return 0


@pytest.fixture
def woodbury_at_any_size(monkeypatch):
    """The Woodbury form wherever its products alone are cheaper (``EIGH_COST`` 0): for tests
    of its numerics on factors so small that counting the ``r × r`` eigendecomposition would
    pick the dense inverse."""
    monkeypatch.setattr(factor_inverse, "EIGH_COST", 0)


# ------------------------------------------------------------------------------ second order
# Independent references for curvature (torch.func only, on the plain model):
# the exact GGN ``J^T H J`` from ``jacrev`` of the model output w.r.t. the parameters and
# ``hessian`` of the loss w.r.t. the output, and the Hessian from ``torch.func.hessian`` of the
# loss w.r.t. the parameters (per-sample terms via per-sample parameter copies).

#: second-order attribute -> extension class (all attributes a second-order test may leave)
SECOND_ORDER = {
    "diag_ggn_exact": ext.DiagGGNExact,
    "diag_ggn_exact_batch": ext.BatchDiagGGNExact,
    "diag_ggn_mc": ext.DiagGGNMC,
    "diag_ggn_mc_batch": ext.BatchDiagGGNMC,
    "diag_h": ext.DiagHessian,
    "diag_h_batch": ext.BatchDiagHessian,
    "kflr": ext.KFLR,
    "kfac": ext.KFAC,
    "kfra": ext.KFRA,
}
ALL_ATTRS = tuple(FIRST_ORDER) + tuple(SECOND_ORDER)


def ggn_reference(plain: nn.Module, lossfunc: Callable, inputs: Inputs, target, out_dim: int = 0):
    """``(blocks, per_sample)``: ``name -> G_p [P, P]`` (the exact GGN block of ``vec(p)``, from the
    full ``J^T H J`` without assuming block structure) and ``name -> [N, *p.shape]``, the
    diagonals of ``J_n^T H_nn J_n`` (``H_nn``: the loss Hessian's block of sample ``n``)."""
    from torch.func import hessian, jacrev

    params = {k: p.detach() for k, p in trainable(plain).items()}
    inputs = _as_tuple(inputs)

    def f(p):
        return functional_call(plain, p, inputs)

    out = f(params).detach()
    jac = jacrev(f)(params)
    hess = hessian(lambda o: lossfunc(o, target))(out)
    n, d = out.shape[out_dim], out.dim()
    hess = hess.movedim(out_dim, 0).movedim(d + out_dim, d).reshape(n, -1, n, out.numel() // n)
    rows = hess.shape[1]
    h_full = hess.reshape(n * rows, n * rows)
    h_blocks = torch.stack([hess[i, :, i, :] for i in range(n)])
    blocks, per_sample = {}, {}
    for k, p in params.items():
        j = jac[k].reshape(*out.shape, p.numel()).movedim(out_dim, 0).reshape(n, rows, p.numel())
        jf = j.reshape(n * rows, p.numel())
        blocks[k] = jf.T @ h_full @ jf
        per_sample[k] = torch.einsum("nrp,nrs,nsp->np", j, h_blocks, j).reshape(n, *p.shape)
    return blocks, per_sample


def hessian_reference(
    plain: nn.Module, lossfunc: Callable, inputs: Inputs, target, in_dim=0, out_dim: int = 0
):
    """``(diag, per_sample)``: ``name -> diag(d^2 L / d p^2)`` (``torch.func.hessian`` of the loss
    w.r.t. the shared parameter) and ``name -> [N, *p.shape]``, the diagonals of
    ``d^2 L / d p_n^2`` with ``p_n`` a copy of ``p`` used by sample ``n`` only."""
    from torch.func import hessian

    params = {k: p.detach() for k, p in trainable(plain).items()}
    inputs = _as_tuple(inputs)
    dims = _dims(inputs, in_dim)
    n = inputs[0].shape[dims[0]]
    diag, per_sample = {}, {}
    for k, p in params.items():

        def shared(q, k=k):
            return lossfunc(functional_call(plain, {**params, k: q}, inputs), target)

        diag[k] = torch.diagonal(hessian(shared)(p).reshape(p.numel(), p.numel())).reshape(p.shape)

        def copies(qs, k=k):
            outs = [
                functional_call(plain, {**params, k: qs[i]}, _split(inputs, n, dims, i))
                for i in range(n)
            ]
            return lossfunc(torch.cat(outs, dim=out_dim), target)

        stacked = p.unsqueeze(0).expand(n, *p.shape).clone()
        h = hessian(copies)(stacked).reshape(n * p.numel(), n * p.numel())
        per_sample[k] = torch.diagonal(h).reshape(n, *p.shape)
    return diag, per_sample


def run_second_order(model: nn.Module, lossfunc: Callable, inputs: Inputs, target, *extensions):
    """Clear every attribute, forward, ``backward`` inside ``collect(*extensions)``; the loss."""
    clear_attributes(model, ALL_ATTRS)
    loss = lossfunc(model(*_as_tuple(inputs)), target)
    with curvopt.collect(*extensions):
        loss.backward()
    return loss


def collect_if_alive(freed: weakref.ref) -> None:
    """Makes sure the object behind ``freed`` (its last reference deleted) is gone, e.g. so that
    a fresh one may reuse its ``id``: reference counting frees it at once; a full collection
    (slow on the suite's large heap) runs only if a reference cycle still holds it."""
    if freed() is not None:
        gc.collect()


def free_earlier_optimizers() -> None:
    """Frees the optimizers of earlier tests left in reference cycles (an armed one would take
    part in this test's passes). The full collection (slow on the suite's large heap) runs
    only when a collection is still open, armed or waiting (``curvopt.core.state``): an
    optimizer that is gone has disarmed its collection."""
    waiting = any(ref() is not None for ref in STATE.armed + STATE.explicit)
    if waiting or STATE.collecting is not None or STATE.open is not None:
        gc.collect()


@pytest.fixture(autouse=True)
def no_earlier_optimizer():
    """Every test starts without the armed collection of an earlier test's optimizer (a resting
    one makes the forward hooks rest: a forward run outside a collect block records nothing)."""
    free_earlier_optimizers()


def assert_no_attributes(
    model: nn.Module, attrs: Sequence[str] = ALL_ATTRS, what: str = ""
) -> None:
    for name, p in model.named_parameters():
        for a in attrs:
            assert a not in p.__dict__, f"{what}{name} got {a}"


# ------------------------------------------------------------------------------ Monte-Carlo


def assert_unbiased(samples: torch.Tensor, exact: torch.Tensor, what: str, z: float = 8.0):
    """``samples [K, ...]`` (independent estimates) have mean ``exact``.

    Per entry: ``|mean − exact| <= 1.25 z · SE`` with ``SE = std / sqrt(K)`` (a false alarm
    below 1e-5 per entry for K = 10, Student's t). Globally: the scale ``s_k = <sample_k, exact>
    / <exact, exact>`` has mean 1 within ``z`` SE, and that SE is small enough that a 10 % bias
    fails (else the check is underpowered and fails too).
    """
    k = samples.shape[0]
    mean, se = samples.mean(0), samples.std(0) / k**0.5
    floor = 1e-10 * exact.abs().max().item() + 1e-14
    bad = (mean - exact).abs() > 1.25 * z * se + floor
    assert not bad.any(), (
        f"{what}: {int(bad.sum())}/{bad.numel()} entries off by more than {1.25 * z} SE; worst "
        f"{((mean - exact).abs() / (se + floor)).max().item():.3g} SE"
    )
    norm = (exact * exact).sum()
    if norm == 0:  # then every entry was checked to be 0 above
        return
    scales = (samples * exact).flatten(1).sum(1) / norm
    scale, scale_se = scales.mean().item(), (scales.std() / k**0.5).item()
    assert z * scale_se < 0.1, f"{what}: underpowered (SE of the scale {scale_se:.3g})"
    assert abs(scale - 1) <= z * scale_se, f"{what}: scale {scale:.5f} != 1 (SE {scale_se:.3g})"


def pytest_collection_finish(session):
    """The objects alive once every test module is imported (torch, the peers, the modules'
    parametrizations: about 600k) move to the collector's permanent generation
    (``gc.freeze``): the full collections that tests run (freeing models and optimizers left
    in reference cycles) and the automatic ones then skip them. Only the cost changes: they
    stay alive as they would, and what the tests create is collected as before."""
    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    """``@pytest.mark.slow`` tests are opt-in: they run only when ``-m`` mentions ``slow``."""
    if "slow" in (config.getoption("markexpr", "") or ""):
        return
    skip = pytest.mark.skip(reason="slow statistical check; opt in with -m slow")
    for item in items:
        if item.get_closest_marker("slow") is not None:
            item.add_marker(skip)


def nearest_kronecker_dense(matrix: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """``kron(F0, F1)`` nearest in Frobenius norm to ``matrix`` (``[a b, a b]``, ``F0`` ``a x a``):
    the best rank-one term of the rearranged matrix, by a dense SVD (Van Loan & Pitsianis)."""
    r = matrix.reshape(a, b, a, b).permute(0, 2, 1, 3).reshape(a * a, b * b)
    u, s, vh = torch.linalg.svd(r)
    return torch.kron((u[:, 0] * s[0]).reshape(a, a), vh[0].reshape(b, b))


def scaled_step(opt, loss, scaler=None, unscale=False, clip=None, params=()):
    """One optimizer step as an AMP loop takes it: ``loss`` (scaled by ``scaler``) backpropagated
    inside ``opt.collect()``, then ``scaler.unscale_(opt)`` (``unscale``) and gradient clipping
    of ``params`` to ``clip`` (its norm returned), then ``opt.step()`` or ``scaler.step(opt);
    scaler.update()``."""
    with opt.collect():
        (loss if scaler is None else scaler.scale(loss)).backward()
    if scaler is not None and unscale:
        scaler.unscale_(opt)
    norm = None if clip is None else float(nn.utils.clip_grad_norm_(params, clip))
    if scaler is None:
        opt.step()
    else:
        scaler.step(opt)
        scaler.update()
    return norm
