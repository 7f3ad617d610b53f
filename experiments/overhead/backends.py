"""The backends of the overhead benchmark: each turns a (problem, quantity) case into a step.

A step is one training iteration's gradient work: ``zero_grad(set_to_none=True)``, forward, loss,
backward, plus what the backend needs to turn its output into the quantity (e.g. torch.func's
reductions of the per-sample gradients). No step keeps a reference to a result, so curvopt
reuses its ``grad_batch`` buffers as in a training loop. ``curvopt`` always runs;
``torch.func`` (``vmap(grad)``), ``opacus`` (``GradSampleModule``), ``backpack`` and
``curvlinops`` (Kronecker factors, GGN matvecs) when importable. A backend that cannot compute
a case raises :class:`Unsupported`.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvopt
from curvopt import extensions as ext
from curvopt import linalg

from .cases import PLAIN, Quantity
from .problems import Problem

Step = Callable[[], None]


class Unsupported(Exception):
    """A backend cannot compute this case (the cell reads ``n/a``)."""


@dataclass
class Instance:
    """One backend's private copy of a problem."""

    model: nn.Module
    X: torch.Tensor
    y: torch.Tensor
    lossfunc: nn.Module

    @property
    def batch_size(self) -> int:
        return self.X.shape[0]

    @classmethod
    def of(cls, problem: Problem, device: str = "cpu", linear_only: bool = False) -> Instance:
        """A fresh copy of ``problem`` (same weights and batch every call) on ``device``; with
        ``linear_only`` every parameter outside Linear/Conv2d layers is frozen."""
        model, X, y, lossfunc = problem.build()
        if linear_only:
            freeze_all_but_linear(model)
        return cls(model.to(device), X.to(device), y.to(device), lossfunc.to(device))


#: the layers whose parameters every Kronecker-factor library supports
LINEAR_LAYERS = (nn.Linear, nn.Conv2d)


def freeze_all_but_linear(model: nn.Module) -> None:
    """``requires_grad_(False)`` on every parameter that is not owned by Linear/Conv2d layers
    alone (a Linear weight tied to an Embedding is frozen too)."""
    linear, other = set(), set()
    for module in model.modules():
        owned = {id(p) for p in module.parameters(recurse=False)}
        (linear if isinstance(module, LINEAR_LAYERS) else other).update(owned)
    for p in model.parameters():
        if id(p) not in linear or id(p) in other:
            p.requires_grad_(False)


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def probe_vector(model: nn.Module, seed: int = 0) -> torch.Tensor:
    """A fixed random vector over the trainable parameters (model dtype), for GGN matvecs."""
    params = trainable(model)
    gen = torch.Generator().manual_seed(seed)
    size = sum(p.numel() for p in params)
    return torch.randn(size, generator=gen, dtype=params[0].dtype)


def reductions(gb: torch.Tensor, attrs: Sequence[str], n: int) -> dict[str, torch.Tensor]:
    """First-order quantities from per-sample gradients ``gb [N, *p]`` (docs/conventions.md)."""
    out: dict[str, torch.Tensor] = {}
    if "grad_batch" in attrs:
        out["grad_batch"] = gb
    if any(a in attrs for a in ("batch_l2", "sum_grad_squared", "variance")):
        sq = gb * gb
        if "batch_l2" in attrs:
            out["batch_l2"] = sq.reshape(n, -1).sum(1)
        if "sum_grad_squared" in attrs or "variance" in attrs:
            sgs = sq.sum(0)
            out["sum_grad_squared"] = sgs
            if "variance" in attrs:
                out["variance"] = sgs / n - (gb.sum(0) / n) ** 2
    return out


class Backend:
    """Turns a problem and a quantity into a step; ``available()`` says why not, if not."""

    name = ""
    #: the optional package the backend needs (None: always available)
    package: str | None = None

    def available(self) -> str | None:
        """Why the backend cannot run here (its package is not importable), or None."""
        if self.package is None:
            return None
        try:
            importlib.import_module(self.package)
        except Exception as e:  # noqa: BLE001
            return f"not importable ({type(e).__name__}: {e})"
        return None

    def make_step(self, inst: Instance, quantity: Quantity) -> Step:
        raise NotImplementedError

    def verify(self, inst: Instance, quantity: Quantity) -> None:
        """After one step: raise :class:`Unsupported` if the quantity was not fully computed."""


def _verify_attributes(backend: str, inst: Instance, quantity: Quantity) -> None:
    """Every parameter that requires grad carries every attribute of ``quantity``."""
    for name, p in inst.model.named_parameters():
        if not p.requires_grad:
            continue
        missing = [a for a in quantity.attrs() if getattr(p, a, None) is None]
        if missing:
            raise Unsupported(f"{backend} wrote no {', '.join(missing)} for {name}")


class PlainBackend(Backend):
    """The baseline: the un-extended model, ``zero_grad``, forward, loss, backward."""

    name = "plain"

    def make_step(self, inst, quantity):
        if quantity.name != PLAIN:
            raise Unsupported("the plain backend only runs the baseline")
        model, X, y, lossfunc = inst.model, inst.X, inst.y, inst.lossfunc

        def step():
            model.zero_grad(set_to_none=True)
            lossfunc(model(X), y).backward()

        return step


class CurvoptBackend(Backend):
    name = "curvopt"

    def verify(self, inst, quantity):
        if not quantity.matvec:
            _verify_attributes(self.name, inst, quantity)

    def make_step(self, inst, quantity):
        if not quantity.extended:
            raise Unsupported("baseline")
        model = curvopt.extend(inst.model)
        lossfunc = curvopt.extend(inst.lossfunc)
        X, y = inst.X, inst.y
        if quantity.matvec:
            G = linalg.GGN(model, lossfunc, [(X, y)])
            v = probe_vector(model).numpy()
            return lambda: G @ v
        if not quantity.extensions:

            def step():
                model.zero_grad(set_to_none=True)
                lossfunc(model(X), y).backward()

            return step
        extensions = [factory() for factory in quantity.extensions]

        def step():
            model.zero_grad(set_to_none=True)
            loss = lossfunc(model(X), y)
            with curvopt.collect(*extensions):
                loss.backward()

        return step


class TorchFuncBackend(Backend):
    """``vmap(grad(loss of one sample))`` via ``functional_call``; reductions computed from it.

    The per-sample loss is divided by N (the ``reduction="mean"`` convention) and ``p.grad`` is
    set to the sum of the per-sample gradients, so the step yields what curvopt's does. Targets
    with more rows than samples (a language model's flattened ``[N·T]``) are split per sample.
    """

    name = "torch.func"

    def make_step(self, inst, quantity):
        from torch.func import functional_call, grad, vmap

        if not quantity.extensions or quantity.order != 1:
            raise Unsupported("torch.func computes per-sample gradients only")
        model, X, y, lossfunc = inst.model, inst.X, inst.y, inst.lossfunc
        n = inst.batch_size
        names = [k for k, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        buffers = dict(model.named_buffers())
        attrs = quantity.attrs()

        rows = y.shape[0] != n  # flattened rows [N·T]: per sample, its T rows (batch-first)
        if rows:
            y = y.reshape(n, -1, *y.shape[1:])  # a sample's mean over its T rows, / N below

        def loss_one(p, x, t):
            out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
            if rows:
                return lossfunc(out, t) / n
            return lossfunc(out, t.unsqueeze(0)) / n

        per_sample = vmap(grad(loss_one), in_dims=(None, 0, 0))

        def step():
            model.zero_grad(set_to_none=True)
            detached = {k: params[k].detach() for k in names}
            grads = per_sample(detached, X, y)
            for k in names:
                gb = grads[k]
                params[k].grad = gb.sum(0)
                reductions(gb, attrs, n)
            del grads

        return step


class OpacusBackend(Backend):
    """``opacus.GradSampleModule`` (hooks, functorch for layers it has no rule for).

    ``p.grad_sample`` is the gradient of each sample's own loss (Opacus rescales the mean), so
    it is multiplied by ``1/N`` before the reductions.
    """

    name = "opacus"
    package = "opacus"

    def make_step(self, inst, quantity):
        from opacus import GradSampleModule

        if not quantity.extensions or quantity.order != 1:
            raise Unsupported("Opacus computes per-sample gradients only")
        try:
            model = GradSampleModule(inst.model, loss_reduction="mean")
        except Exception as e:
            raise Unsupported(f"GradSampleModule: {type(e).__name__}: {e}") from e
        X, y, lossfunc = inst.X, inst.y, inst.lossfunc
        n = inst.batch_size
        params = [p for p in model.parameters() if p.requires_grad]
        attrs = quantity.attrs()

        def step():
            model.zero_grad(set_to_none=True)
            lossfunc(model(X), y).backward()
            for p in params:
                gb = p.grad_sample
                if gb is None:
                    raise Unsupported("no grad_sample for a parameter")
                reductions(gb.mul_(1.0 / n), attrs, n)

        return step


#: curvopt options BackPACK has no argument for, with the value that is BackPACK's behaviour
BACKPACK_IMPLIED = {"kfac_approx": "expand"}


def backpack_options(mine: ext.Extension, theirs: type) -> dict:
    """``mine.options`` that BackPACK's extension class ``theirs`` takes; :class:`Unsupported`
    for an option BackPACK lacks unless it is set to what BackPACK does anyway."""
    accepted = inspect.signature(theirs).parameters
    options = {}
    for key, value in mine.options.items():
        if key in accepted:
            options[key] = value
        elif BACKPACK_IMPLIED.get(key, object()) != value:
            raise Unsupported(f"BackPACK's {theirs.__name__} has no option {key}={value!r}")
    return options


class BackpackBackend(Backend):
    """BackPACK: ``extend`` model and loss, ``with backpack(...)`` around ``backward``.

    BackPACK's extensions have curvopt's class names, options and attribute names (curvopt's
    conventions follow BackPACK), so any quantity maps by name, second-order ones included.
    """

    name = "backpack"
    package = "backpack"

    def verify(self, inst, quantity):
        # BackPACK only warns about modules it has no rule for (here: attention, LayerNorm)
        _verify_attributes(self.name, inst, quantity)

    def make_step(self, inst, quantity):
        import backpack
        from backpack import extensions as bext

        if quantity.matvec:
            raise Unsupported("BackPACK has no GGN operator")
        if quantity.extended and quantity.extensions:
            exts = []
            for factory in quantity.extensions:
                mine = factory()
                theirs = getattr(bext, type(mine).__name__, None)
                if theirs is None:
                    raise Unsupported(f"BackPACK has no {type(mine).__name__}")
                exts.append(theirs(**backpack_options(mine, theirs)))
        elif quantity.extended:
            exts = []
        else:
            raise Unsupported("baseline")
        model = backpack.extend(inst.model)
        lossfunc = backpack.extend(inst.lossfunc)
        X, y = inst.X, inst.y

        def step():
            model.zero_grad(set_to_none=True)
            loss = lossfunc(model(X), y)
            if exts:
                with backpack.backpack(*exts):
                    loss.backward()
            else:
                loss.backward()

        return step


class CurvlinopsBackend(Backend):
    """curvlinops: ``KFACLinearOperator`` (KFAC: ``fisher_type="mc"``, KFLR: ``"type-2"``)
    built and its factors computed from the batch in each step, and ``GGNLinearOperator @ v``
    (torch in, torch out: its own interface) for ``GGN_matvec``.

    Its KFAC covers Linear and Conv2d layers only: a model with other parameters is
    :class:`Unsupported` (the ``*_linear`` quantities compare on the Linear parameters). Its
    GGN uses forward-mode AD, which the fused CPU attention kernels lack: the matvec runs under
    ``sdpa_kernel(SDPBackend.MATH)`` (the same function, computed by the unfused kernel).
    """

    name = "curvlinops"
    package = "curvlinops"
    FISHER_TYPE = {"KFAC": "mc", "KFLR": "type-2"}

    def kfac(self, inst: Instance, quantity: Quantity):
        """The operator with its factors computed (what one step produces)."""
        from curvlinops import KFACLinearOperator

        mine = quantity.extensions[0]()
        fisher = self.FISHER_TYPE.get(type(mine).__name__)
        if fisher is None:
            raise Unsupported(f"curvlinops has no {type(mine).__name__}")
        options = {"kfac_approx": mine.options.get("kfac_approx", "expand")}
        if fisher == "mc":
            options["mc_samples"] = mine.options.get("mc_samples", 1)
        try:
            op = KFACLinearOperator(
                *_operator_args(inst),
                fisher_type=fisher,
                num_per_example_loss_terms=inst.y.numel() // inst.batch_size,
                **_operator_options(inst),
                **options,
            )
        except NotImplementedError as e:
            raise Unsupported(f"KFACLinearOperator: {e}") from e
        op.compute_kronecker_factors()
        return op

    def verify(self, inst, quantity):
        if quantity.matvec:
            return
        op = self.kfac(inst, quantity)
        if set(op._gradient_covariances) != set(op._mapping):
            raise Unsupported("curvlinops computed no factors for some layers")

    def make_step(self, inst, quantity):
        from curvlinops import GGNLinearOperator

        if quantity.matvec:
            G = GGNLinearOperator(*_operator_args(inst), **_operator_options(inst))
            v = probe_vector(inst.model)

            def step():
                with sdpa_kernel(SDPBackend.MATH):
                    return G @ v

            return step
        if not quantity.extensions or quantity.order != 2:
            raise Unsupported("curvlinops: Kronecker factors and GGN matvecs only")
        held = [self.kfac(inst, quantity)]  # fails early (unsupported layers)

        def step():
            # the last factors stay alive while the next are computed, as with the attributes
            # curvopt and BackPACK overwrite (and as an optimizer holding its curvature)
            held[0] = self.kfac(inst, quantity)

        return step


def _operator_args(inst: Instance) -> tuple:
    """curvlinops operators' leading arguments: the model, loss, parameters and one batch."""
    return inst.model, inst.lossfunc, trainable(inst.model), [(inst.X, inst.y)]


def _operator_options(inst: Instance) -> dict:
    """The options every curvlinops operator here takes: the batch is all the data, and
    determinism is not re-checked on each build."""
    return {"check_deterministic": False, "num_data": inst.batch_size}


BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        CurvoptBackend(),
        TorchFuncBackend(),
        OpacusBackend(),
        BackpackBackend(),
        CurvlinopsBackend(),
    )
}
