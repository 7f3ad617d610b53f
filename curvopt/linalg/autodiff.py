"""Curvature-matrix products by automatic differentiation (``torch.func``), one batch at a time.

With ``f(θ)`` the model output (the loss input, ``[R, *F]``, row ``r`` of dim 0 a sample) and
``J = ∂f/∂θ``:

* :class:`OutputProducts`: ``Jᵀ M J V`` for a symmetric ``M`` on the output space, the ``K``
  columns of ``V`` batched by ``vmap``. Forward mode (:func:`jtmj_forward`): one forward
  computes ``f`` and the tangents ``J V`` (``jvp``) while recording ``f``'s graph, then ``M``,
  then ``Jᵀ`` by one pullback: a forward, its tangents and a backward. Where the model has no
  forward-mode derivative (an op or ``autograd.Function`` without one, random ops under
  ``vmap``), reverse over reverse (:func:`jtmj_reverse`): ``J V`` as the transpose of the
  pullback ``u ↦ Jᵀ u``, which every differentiable op supports, at about two backwards more;
* :func:`hessian_matmat`: ``∇²_θ L V`` by double backward (reverse over reverse).

curvopt's hooks are suspended meanwhile (these products never touch ``collect``), and
attention runs in PyTorch's math kernel, the one whose backward is itself differentiable.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call, grad, jvp, vjp, vmap
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.modules.batchnorm import _NormBase

from curvopt.core import inputs as io
from curvopt.errors import UnsupportedModuleError, module_error
from curvopt.core.state import STATE

Tensors = Sequence[torch.Tensor]

#: columns per vectorised product (bounds memory at CHUNK forward passes)
CHUNK = 32


@contextlib.contextmanager
def _differentiable() -> Iterator[None]:
    """Hooks suspended, the math attention kernel and no fused ``MultiheadAttention`` /
    ``TransformerEncoderLayer`` fast path (the same functions, by kernels with derivatives
    of every order and mode); torch.func's refusal of ``torch.utils.checkpoint`` (either
    ``use_reentrant``) raised as what to do instead."""
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    with STATE.suspend(), sdpa_kernel(SDPBackend.MATH):
        try:
            yield
        except RuntimeError as error:
            if _raised_inside_checkpoint(error):
                raise UnsupportedModuleError(
                    "curvopt.linalg's exact operators (GGN, Hessian, EmpiricalFisher, FisherMC) "
                    "differentiate the model with torch.func, which cannot run through "
                    "torch.utils.checkpoint (with either use_reentrant). Build them on the model "
                    "without gradient checkpointing (the matrix is the same; for Hugging Face "
                    "models model.gradient_checkpointing_disable()), or use linalg.Diagonal / "
                    "linalg.KFAC, which support it."
                ) from error
            raise
        finally:
            torch.backends.mha.set_fastpath_enabled(fastpath)


def _raised_inside_checkpoint(error: BaseException) -> bool:
    """Whether a frame of ``torch.utils.checkpoint`` is on ``error``'s traceback."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == torch.utils.checkpoint.__file__:
            return True
        tb = tb.tb_next
    return False


def model_function(model: nn.Module, names: Sequence[str], inputs, output=None) -> Callable:
    """``θ ↦ model(inputs)`` (the tensor ``output`` selects, :mod:`curvopt.core.inputs`) with the
    parameters ``names`` replaced by ``θ`` (a tuple)."""
    for module in model.modules():
        if isinstance(module, _NormBase) and module.training and module.track_running_stats:
            raise module_error(
                module,
                "in training mode it updates its running statistics in every forward, which "
                "curvopt.linalg's exact operators (differentiated by torch.func) cannot run "
                "through; call model.eval() for the matrix of the model as it predicts, or build "
                "the norm with track_running_stats=False for batch statistics",
            )
    args, kwargs = io.split(inputs)

    def forward(*params):
        return io.select(functional_call(model, dict(zip(names, params)), args, kwargs), output)

    return forward


class OutputProducts:
    """``Jᵀ M J V`` of one operator's model: forward mode until the model refuses it, then
    reverse over reverse for good (the same product; a failed attempt leaves the RNG as it
    found it, so sampled ``M`` are the same draws)."""

    def __init__(self):
        self.forward_mode = True

    def __call__(
        self,
        forward: Callable,
        params: Tensors,
        vectors: Tensors,
        output_operator: Callable[[torch.Tensor], Callable[[torch.Tensor], torch.Tensor]],
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``(f, Jᵀ M J V)``: ``vectors [[K, *p.shape]]``; ``output_operator(f)`` returns
        ``u ↦ M u`` for one output-shaped ``u``; ``f`` the loss input (detached)."""
        params = tuple(p.detach() for p in params)
        if self.forward_mode:
            rng = _rng_state(params[0].device)
            try:
                return jtmj_forward(forward, params, vectors, output_operator)
            except Exception:  # noqa: BLE001 - the reverse path raises the model's own errors
                _set_rng_state(params[0].device, rng)
                result = jtmj_reverse(forward, params, vectors, output_operator)
                self.forward_mode = False
                return result
        return jtmj_reverse(forward, params, vectors, output_operator)


def jtmj_forward(forward, params, vectors, output_operator) -> tuple[torch.Tensor, list]:
    """``(f, Jᵀ M J V)`` with ``J V`` by ``jvp``: per chunk of columns one forward, computing
    ``f`` once and its tangents (vmapped over the columns), under the ``vjp`` that records
    ``f``'s graph; ``M`` built once per batch, from the first chunk's ``f``. A single column
    runs without ``vmap``, whose batching rules split some kernels (a convolution's backward
    into one call per input)."""
    apply_m, parts, loss_input = None, [], None
    with _differentiable():
        for chunk in zip(*(v.split(CHUNK) for v in vectors)):
            single = len(chunk[0]) == 1

            def linearized(*ps, chunk=chunk, single=single):
                if single:
                    output, tangent = jvp(forward, ps, tuple(c[0] for c in chunk))
                    return output, tangent[None]
                return vmap(lambda *cols: jvp(forward, ps, cols), out_dims=(None, 0))(*chunk)

            output, pullback, tangents = vjp(linearized, *params, has_aux=True)
            if apply_m is None:
                loss_input = output.detach()
                apply_m = output_operator(loss_input)
            if single:
                parts.append([r[None] for r in pullback(apply_m(tangents[0]))])
            else:
                parts.append(vmap(lambda t, back=pullback, m=apply_m: back(m(t)))(tangents))
    if len(parts) == 1:
        return loss_input, list(parts[0])
    return loss_input, [torch.cat(columns) for columns in zip(*parts)]


def jtmj_reverse(forward, params, vectors, output_operator) -> tuple[torch.Tensor, list]:
    """``(f, Jᵀ M J V)`` with ``J V`` as the transpose of the pullback (reverse over reverse)."""
    with _differentiable():
        output, pullback = vjp(forward, *params)
        output = output.detach()
        apply_m = output_operator(output)
        _, transpose = vjp(pullback, torch.zeros_like(output))

        def one(*vector):
            return pullback(apply_m(transpose(vector)[0]))

        result = vmap(one, chunk_size=CHUNK)(*vectors)
    return output, list(result)


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def hessian_matmat(
    forward: Callable, loss: Callable, params: Tensors, vectors: Tensors
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """``(f, ∇²_θ loss(forward(θ)) V)`` by reverse-over-reverse differentiation (``f`` the
    loss input, detached)."""
    params = tuple(p.detach() for p in params)

    def objective(*ps):
        output = forward(*ps)
        return loss(output), output

    with _differentiable():
        gradient = grad(objective, argnums=tuple(range(len(params))), has_aux=True)
        _, pullback, output = vjp(gradient, *params, has_aux=True)
        result = vmap(lambda *v: pullback(v), chunk_size=CHUNK)(*vectors)
    return output.detach(), list(result)


def loss_hessian(loss: Callable) -> Callable:
    """``f ↦ (u ↦ ∇²_f loss(f) u)``: the loss Hessian on the output space (exact GGN), as the
    pullback of the gradient (the Hessian is symmetric): reverse over reverse, because the
    forward-mode derivative of some losses' backward fails (``mse_loss``'s with "mean" writes
    into an immutable zero tangent)."""

    def operator(output):
        _, pullback = vjp(grad(loss), output)
        return lambda u: pullback(u)[0]

    return operator


def per_row_outer(columns: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """``u ↦ Σ_m s_m ⟨s_m, u⟩_r`` for ``columns = S [M, R, *F]``: the block-diagonal
    ``M_r = Σ_m s_mr s_mrᵀ``, ``⟨·,·⟩_r`` summing over all dims but the row ``r``."""

    def apply(u):
        coeff = (columns * u).flatten(2).sum(2)  # [M, R]
        return torch.einsum("mr,mr...->r...", coeff, columns)

    return apply
