"""``curvopt.verify``: one batch of a model checked against ``torch.func``, for the graph
patterns curvopt cannot detect by itself (see README, "When to run curvopt.verify").

The reference never uses curvopt's hooks: every sample ``n`` runs through the model alone with
its own copy ``theta_n`` of the parameters (a batch of one), the outputs are concatenated along
``batch_dim`` and the loss is computed on them exactly as ``loss_of`` computes it. Then

* per-sample gradients are ``dL/d theta_n`` (``grad_batch``, and ``batch_l2``,
  ``sum_grad_squared``, ``variance`` from them);
* ``diag_ggn_exact``/``diag_ggn_exact_batch`` are the diagonals of ``J^T H J`` with ``J`` the
  Jacobian of the concatenated output w.r.t. the shared / the per-sample parameters and ``H``
  the loss Hessian w.r.t. that output;
* ``diag_h``/``diag_h_batch`` are the diagonals of ``d^2 L / d theta^2`` (shared / per sample).

A model that mixes samples (batch statistics, ``h - h.mean(0)``) or that curvopt reads wrongly
gives a different answer from its per-sample re-runs, and the mismatch is reported. Monte-Carlo
and Kronecker quantities are approximations without a per-batch reference and are not checked.
Cost: ``O(N P)`` memory for the per-sample parameter copies, Jacobians and Hessians of size
``P``: meant for a few samples of a small or sliced model.
"""

from __future__ import annotations

from typing import Callable, Dict, Sequence

import torch
from torch.func import functional_call, hessian, jacrev

from curvopt.core import inputs as io
from curvopt.frontend.collect import collect
from curvopt.errors import CurvoptError, UnsupportedModuleError
from curvopt.extensions.base import Extension
from curvopt.engine.producers import TABLE
from curvopt.core.state import STATE


def _checked(ext: Extension) -> bool:
    """Quantities with a reference: first order (declared as a function of the per-sample
    gradients) and the exact, not Monte-Carlo, diagonals."""
    q = ext.quantity
    if q.reference is not None:
        return True
    return TABLE[q.producer].reference is not None and getattr(ext, "source", None) == "exact"


class VerificationError(CurvoptError, AssertionError):
    """curvopt's numbers for a model differ from the ``torch.func`` reference.

    Raised by :func:`verify`; its message lists each parameter and attribute whose relative
    error exceeds the tolerance.

    Args:
        *args: the message, as for any exception.

    Example::

        try:
            curvopt.verify(model, lossfunc, X[:4], y[:4], [ext.BatchGrad()])
        except curvopt.VerificationError as error:
            print(error)  # which parameters and attributes differ, and by how much
    """


def verify(
    model: torch.nn.Module,
    loss_of: Callable,
    X,
    y,
    extensions: Sequence[Extension],
    batch_dim: int = 0,
    rtol: float = None,
    output: io.Selector = None,
) -> Dict[str, Dict[str, float]]:
    """Relative errors ``{parameter name: {attribute: max|curvopt - ref| / max|ref|}}``.

    ``loss_of(output, y)`` computes the loss with an extended loss module as the training code
    does (e.g. ``lambda out, y: lossfunc(out.reshape(-1, V), y.reshape(-1))``); ``X`` is one
    small batch along ``batch_dim``: a tensor, a tuple of inputs (``model(*X)``) or a dict
    (``model(**X)``, Hugging Face style; tensors with ``N`` entries along ``batch_dim`` are split
    into samples, others shared). ``output`` picks the tensor ``loss_of`` takes from the model's
    output (default: the output itself, or the ``.logits`` of a ``ModelOutput``; a name or a
    callable otherwise, see :mod:`curvopt.core.inputs`). Parameters and ``.grad`` are left
    as they were; the checked attributes are written as by ``collect``.

    Args:
        model: the extended model.
        loss_of: ``(output, y) -> loss``, through an extended loss module.
        X: one small batch (tensor, tuple or dict of inputs).
        y: its targets.
        extensions: the quantities to check, e.g. ``[ext.BatchGrad(), ext.DiagGGNExact()]``.
        batch_dim: the dim of ``X``, the output and ``y`` that indexes samples.
        rtol: the largest relative error accepted.
        output: which tensor of the model's output ``loss_of`` takes.

    Returns:
        ``{parameter name: {attribute: relative error}}``.

    Raises:
        VerificationError: an error exceeds ``rtol`` (default ``1e-6`` in float64, ``1e-3``
            otherwise).

    Example::

        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        errors = curvopt.verify(model, lossfunc, X[:4], y[:4], [ext.BatchGrad()])
    """
    params = {k: p for k, p in model.named_parameters() if p.requires_grad}
    grads = {k: p.grad for k, p in params.items()}
    with collect(*extensions):
        loss_of(io.select(io.call(model, X), output), y).backward()
    for k, p in params.items():
        p.grad = grads[k]
    wanted = {e.attr: e.quantity for e in extensions if _checked(e)}
    detached = {k: p.detach() for k, p in params.items()}
    ref = _reference(model, loss_of, X, y, batch_dim, detached, output)
    with STATE.suspend():
        return _compare(params, wanted, ref, rtol, io.first_tensor(X))


def _compare(params, wanted, ref, rtol, X):
    if rtol is None:
        rtol = 1e-6 if X.dtype == torch.float64 or not X.is_floating_point() else 1e-3
    errors, failed = {}, []
    for k, p in params.items():
        errors[k] = {}
        for attr, q in wanted.items():
            got, want = getattr(p, attr), ref(q, k)
            scale = float(want.abs().max()) if want.numel() else 0.0
            diff = float((got - want).abs().max())
            err = diff / scale if scale > 0 else diff
            errors[k][attr] = err
            if err > rtol and diff > 1e3 * torch.finfo(want.dtype).eps:
                failed.append(f"{k}.{attr}: relative error {err:.3g}")
    if failed:
        raise VerificationError(
            "curvopt's quantities differ from the torch.func reference (per-sample re-runs of "
            "the model): " + "; ".join(failed) + ". Do not trust them for this model, which "
            "likely mixes samples or uses a parameter outside its module; see "
            "docs/support.md#when-to-run-curvoptverify."
        )
    return errors


def _second_derivatives(f: Callable, q: torch.Tensor) -> torch.Tensor:
    """``torch.func.hessian(f)(q)``; a model with an op that torch cannot differentiate twice
    (``hardsigmoid``: its backward has no derivative) raises, naming the op and the fix."""
    try:
        return hessian(f)(q)
    except (NotImplementedError, RuntimeError) as error:
        if "derivative" not in str(error) and "forward AD" not in str(error):
            raise
        raise UnsupportedModuleError(
            "curvopt.verify: torch has no second derivative of an op of the model for the "
            f"torch.func reference of diag_h ({str(error).strip().splitlines()[0][:120]}). "
            "Write such a piecewise-linear op from clamp in the model you pass to verify, "
            "hardsigmoid(x) = (x + 3).clamp(0, 6) / 6; see docs/support.md#diaghessian."
        ) from error


def _reference(model, loss_of, X, y, batch_dim, params, output):
    """Lazily computed reference values: ``ref(quantity, name)``."""
    n = io.first_tensor(X).shape[batch_dim]
    samples = [io.split(io.sample(X, batch_dim, n, i)) for i in range(n)]
    names = list(params)
    cache: Dict[str, Dict[str, torch.Tensor]] = {}

    def output_of(copies):
        outs = [
            io.select(functional_call(model, {k: copies[k][i] for k in names}, *x), output)
            for i, x in enumerate(samples)
        ]
        return torch.cat(outs, batch_dim)

    def per_sample_loss(copies):  # copies: name -> [N, *p.shape]
        return loss_of(output_of(copies), y)

    def stacked():
        return {k: p.unsqueeze(0).expand(n, *p.shape).clone() for k, p in params.items()}

    def first():
        if "g" not in cache:
            cache["g"] = torch.func.grad(per_sample_loss)(stacked())
        return cache["g"]

    def ggn(batched: bool):
        key = f"ggn{batched}"
        if key not in cache:
            copies = stacked()
            out = output_of(copies).detach()
            jac = jacrev(output_of)(copies)
            h = hessian(lambda o: loss_of(o, y))(out).reshape(out.numel(), out.numel())
            result = {}
            for k, p in params.items():
                j = jac[k].reshape(out.numel(), n, -1)  # [O, N, P]
                if batched:
                    d = torch.einsum("onp,oq,qnp->np", j, h, j).reshape(n, *p.shape)
                else:
                    js = j.sum(1)
                    d = torch.einsum("op,oq,qp->p", js, h, js).reshape(p.shape)
                result[k] = d
            cache[key] = result
        return cache[key]

    def hess(k: str, batched: bool):
        if batched:

            def f(q):
                return per_sample_loss({**stacked(), k: q})

            q = stacked()[k]
        else:

            def f(q):
                return per_sample_loss({**stacked(), k: q.unsqueeze(0).expand(n, *q.shape)})

            q = params[k]
        h = _second_derivatives(f, q).reshape(q.numel(), q.numel())
        return torch.diagonal(h).reshape(q.shape)

    def ref(q, k: str):
        if q.reference is not None:
            return q.reference(first()[k])
        if TABLE[q.producer].reference == "ggn":
            return ggn(q.per_sample)[k]
        return hess(k, q.per_sample)

    return ref
