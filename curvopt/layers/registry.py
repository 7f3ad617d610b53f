"""Registry of per-module rules.

A *rule* knows how to turn what a module saw in the forward pass (its inputs) and what flows
back into it (the gradient of the loss w.r.t. its output) into per-sample quantities of the
module's own parameters. Adding support for a new layer type is one file with one class::

    @register(nn.MyLayer)
    class MyLayerRule(LayerRule):
        def batch_grad(self, call, name, out=None): ...

Module types without a registered rule fall back to :class:`curvopt.layers.generic.GenericRule`
(``torch.func`` over single samples); so do modules whose parameters are reparametrized (weight
norm, spectral norm, ``torch.nn.utils.parametrize``), whatever their type
(:mod:`curvopt.layers.reparametrized`). Types of other libraries that curvopt must not import
(Hugging Face's ``Conv1D``, timm's layers) are registered by class name with
:func:`register_name`. Every module of ``curvopt.layers`` is imported by the package, so the one
file is all there is to add.

A rule covers the subclasses of its types that compute the same function: a subclass that
defines one of the rule's :attr:`LayerRule.function_methods` (``forward``; a convolution's
``_conv_forward`` too) anywhere below the registered type computes something else (timm's
``BatchNormAct2d`` applies an activation after ``nn.BatchNorm2d``), and gets a rule registered
for it (by type or name) or the generic one, with a warning naming the override
(:func:`subclass_note`). Every rule method that computes runs guarded (:func:`_guarded`): an
exception of torch from inside it (a shape the rule did not expect) becomes curvopt's
``UnsupportedModuleError`` naming the module.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable, Dict, List, Optional, Tuple, Type

import torch
from torch import nn
from torch.nn.utils import parametrize
from torch.nn.utils.spectral_norm import SpectralNorm
from torch.nn.utils.weight_norm import WeightNorm

from curvopt.errors import CurvoptError, module_error
from curvopt.layers.eigenbasis import CHUNK_ELEMENTS, eigen_moment_of

_RULES: Dict[Type[nn.Module], "LayerRule"] = {}
_NAMED: Dict[str, "LayerRule"] = {}
#: each module type's rule once looked up (:func:`rule_for`; emptied by every registration)
_RESOLVED: "weakref.WeakKeyDictionary[type, LayerRule]" = weakref.WeakKeyDictionary()
_FALLBACK: List["LayerRule"] = []
_REPARAMETRIZED: List["LayerRule"] = []


def moment_in_chunks(call, per_sample: int, moment: Callable) -> torch.Tensor:
    """``Σ`` of ``moment(part)`` over the calls ``part`` of consecutive samples of ``call``
    (``Call.slice``), each of at most ``CHUNK_ELEMENTS // per_sample`` samples (one at least):
    an ``EKFAC`` moment whose per-sample operands hold ``per_sample`` elements, summed in the
    order of the samples."""
    n = call.batch_size
    step = max(1, CHUNK_ELEMENTS // max(1, per_sample))
    total = None
    for start in range(0, n, step):
        part = moment(call.slice(start, min(n, start + step)))
        total = part if total is None else total.add_(part)
    return total


def register(*module_types: Type[nn.Module]) -> Callable:
    """Class decorator: register one rule instance for the given module types."""

    def wrap(rule_cls):
        rule = rule_cls()
        for module_type in module_types:
            _RULES[module_type] = rule
        _RESOLVED.clear()
        return rule_cls

    return wrap


def register_name(*class_names: str) -> Callable:
    """Class decorator: register one rule instance for module classes called ``class_names``
    (whatever library defines them): a bare name (``"Conv1D"``) matches any class of that name,
    a qualified one (``"timm.layers.norm.LayerNorm2d"``: module and class name) only that class;
    the rule's :meth:`LayerRule.check` verifies the layout."""

    def wrap(rule_cls):
        rule = rule_cls()
        for class_name in class_names:
            _NAMED[class_name] = rule
        _RESOLVED.clear()
        return rule_cls

    return wrap


def register_fallback(rule: "LayerRule") -> "LayerRule":
    """Make ``rule`` the rule of every module type without a registered one."""
    _FALLBACK[:] = [rule]
    return rule


def register_reparametrized(rule: "LayerRule") -> "LayerRule":
    """Make ``rule`` the rule of every module with a :func:`reparametrization`."""
    _REPARAMETRIZED[:] = [rule]
    return rule


def reparametrization(module: nn.Module) -> Optional[str]:
    """How ``module``'s parameters are reparametrized (its own rule would treat the originals
    as the layer's weights), or ``None``: ``torch.nn.utils.parametrize`` (the
    ``parametrizations`` API) or the older ``weight_norm``/``spectral_norm`` forward hooks."""
    if parametrize.is_parametrized(module):
        return ", ".join(
            f"{name!r} (torch.nn.utils.parametrize: "
            + ", ".join(type(f).__name__ for f in functions)
            + ")"
            for name, functions in module.parametrizations.items()
        )
    for hook in module._forward_pre_hooks.values():
        if isinstance(hook, WeightNorm):
            return f"{hook.name!r} (torch.nn.utils.weight_norm)"
        if isinstance(hook, SpectralNorm):
            return f"{hook.name!r} (torch.nn.utils.spectral_norm)"
    return None


def rule_for(module: nn.Module) -> "LayerRule":
    """The rule of the nearest type in ``module``'s MRO with a registered one (by type, else by
    qualified or bare class name) if ``module`` computes that type's function (:func:`_override`),
    else the generic fallback (warned once per type, :func:`subclass_note`). A module with a
    :func:`reparametrization` gets the reparametrized-module rule."""
    if (module._forward_pre_hooks or "parametrizations" in module._modules) and reparametrization(
        module
    ):
        return _REPARAMETRIZED[0]
    klass = type(module)
    rule = _RESOLVED.get(klass)  # (one lookup: ``in`` then ``[]`` makes two weak references)
    if rule is None:
        rule = _RESOLVED[klass] = _resolve(klass)
    return rule


def _registered(klass: type) -> Optional["LayerRule"]:
    """The rule registered for ``klass`` itself, by type or by name, or ``None``."""
    if klass in _RULES:
        return _RULES[klass]
    qualified = f"{klass.__module__}.{klass.__qualname__}"
    return _NAMED.get(qualified, _NAMED.get(klass.__name__))


def _registered_base(klass: type) -> Tuple[Optional[type], Optional["LayerRule"]]:
    """The nearest type in ``klass``'s MRO with a registered rule, and that rule."""
    for base in klass.__mro__:
        rule = _registered(base)
        if rule is not None:
            return base, rule
    return None, None


def _override(klass: type, base: type, rule: "LayerRule") -> Optional[Tuple[type, str]]:
    """``(subclass, method)``: the first class of ``klass``'s MRO below ``base`` that defines
    one of ``rule``'s :attr:`LayerRule.function_methods`, or ``None``: ``klass`` computes
    ``base``'s function."""
    for cls in klass.__mro__:
        if cls is base:
            return None
        for method in rule.function_methods:
            if method in vars(cls):
                return cls, method
    return None


def _label(klass: type) -> str:
    """``nn.LayerNorm`` for torch's modules, ``package.Class`` for others."""
    if klass.__module__.startswith("torch.nn."):
        return f"nn.{klass.__qualname__}"
    return f"{klass.__module__.split('.')[0]}.{klass.__qualname__}"


def subclass_note(klass: type) -> Optional[str]:
    """Why modules of type ``klass`` do not get the rule of the registered type they subclass
    (one clause: the subclass and the method it overrides), or ``None`` where they get it."""
    base, rule = _registered_base(klass)
    override = None if base is None else _override(klass, base, rule)
    if override is None:
        return None
    cls, method = override
    return (
        f"{klass.__qualname__} subclasses {_label(base)} but computes something else in its "
        f"{method} (defined by {cls.__qualname__}), so the generic rule (torch.func, one "
        f"forward per sample) computes its quantities, not {_label(base)}'s"
    )


def _resolve(klass: type) -> "LayerRule":
    base, rule = _registered_base(klass)
    if base is None:
        return _FALLBACK[0]
    if _override(klass, base, rule) is None:
        return rule
    warnings.warn(
        f"curvopt: {subclass_note(klass)}. Register a rule for "
        f"{klass.__name__} with curvopt.layers.register where it computes the same function; "
        "see docs/conventions.md#subclasses-of-supported-layers.",
        stacklevel=4,
    )
    return _FALLBACK[0]


def mixes(module: nn.Module) -> bool:
    """Whether ``module``'s rule says it mixes samples (:meth:`LayerRule.mixes_samples`)."""
    return rule_for(module).mixes_samples(module)


def mixing(calls):
    """The first of ``calls`` (module calls: anything with a ``module``) whose module
    :func:`mixes` samples, or None."""
    for call in calls:
        if mixes(call.module):
            return call
    return None


#: the methods of a rule that compute from a module call (first argument: the call, or the
#: module): run guarded (:func:`_guarded`)
_COMPUTING = (
    "batch_grad",
    "batch_l2",
    "sum_grad_squared",
    "column_grads",
    "expanded_batch_grad",
    "column_diag",
    "grad_sum",
    "projected_sum",
    "kron_output_factor",
    "kron_input_factor",
    "eigen_correction",
    "weighted_squares",
)


def _guard(rule_cls: type) -> None:
    """Guard every computing method ``rule_cls`` defines itself (:func:`_guarded`)."""
    for name in _COMPUTING:
        method = vars(rule_cls).get(name)
        if callable(method) and not getattr(method, "guarded", False):
            setattr(rule_cls, name, _guarded(method))


def _guarded(method: Callable) -> Callable:
    """``method`` (a rule's, first argument a call or a module), raising torch's errors from
    inside it (``RuntimeError``, ``IndexError``: a shape or layout the rule did not expect) as
    ``UnsupportedModuleError`` naming the module; curvopt's own errors and running out of
    memory pass unchanged."""

    @functools.wraps(method)
    def run(rule, subject, *args, **kwargs):
        try:
            return method(rule, subject, *args, **kwargs)
        except (CurvoptError, torch.OutOfMemoryError):
            raise
        except (RuntimeError, IndexError) as error:
            module = subject if isinstance(subject, nn.Module) else getattr(subject, "module", None)
            if not isinstance(module, nn.Module):
                raise
            cause = (str(error).strip() or type(error).__name__).splitlines()[0]
            raise module_error(
                module,
                f"its rule {type(rule).__name__} failed on this call's inputs ({cause}). "
                "Check that the module is called as its type documents it, or register a rule "
                "for it with curvopt.layers.register; see docs/support.md#modules-without-a-rule.",
            ) from error

    run.guarded = True
    return run


class LayerRule:
    """Per-module rule for first-order quantities.

    Every method receives a :class:`curvopt.core.calls.Call`: the module, the positional
    and keyword inputs it was called with (``call.args``, ``call.kwargs``) and the gradient of
    the loss w.r.t. its output (``call.grad_out``; a tuple for modules with several outputs),
    and the parameter name (``"weight"``, ``"bias"``, ...). Per-sample results have the batch
    dimension first: ``[N, *p.shape]``; ``out``, when given, is a buffer of that shape to write
    into (a rule whose fastest kernel allocates its own result may return that instead).

    Only :meth:`batch_grad` is required. The others are optional fast paths that avoid
    materialising ``[N, *p.shape]``; returning ``None`` means "derive it from batch_grad".
    """

    #: the methods of a registered module type that define the function it computes: a
    #: subclass that defines one computes something else, and gets this rule only where it is
    #: registered for the subclass too (:func:`rule_for`)
    function_methods: Tuple[str, ...] = ("forward",)
    #: whether the rule also owns the parameters of the module's children
    #: (modules whose forward uses their children's parameters functionally, e.g. attention)
    owns_children: bool = False
    #: whether the module acts on every position of its leading dims alike (Linear, LayerNorm,
    #: Embedding), so that the batch may be its dim 1 in a sequence-first model
    positionwise: bool = False
    #: whether the rule re-runs the module sample by sample (the generic fallback): a raw
    #: parameter of the module that meets the batch by an add or expand is then read off the
    #: graph instead, in first order (``layers.parameter``)
    reruns_module: bool = False
    #: whether the rule re-runs a forward of the module that may draw random numbers
    #: (attention dropout): the forward then keeps the generator state it starts from where
    #: :meth:`draws_random` says it draws, as ``call.random``, to replay it
    replays_random_forward: bool = False

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        _guard(cls)

    def batch_dim(self, module: nn.Module) -> int:
        """Dimension of the inputs/outputs that indexes samples."""
        return 0

    def output_batch_dims(self, module: nn.Module, count: int) -> List[int]:
        """The dim indexing samples in each of the module's ``count`` tensor outputs."""
        return [self.batch_dim(module)] * count

    def mixes_samples(self, module: nn.Module) -> bool:
        """Whether the module's output for one sample depends on the others (batch statistics):
        a pass through it is coupled (``engine.curvature``), with no per-sample quantities."""
        return False

    def draws_random(self, module: nn.Module) -> bool:
        """Whether the module's forward draws random numbers now (read before each forward of a
        rule with :attr:`replays_random_forward`)."""
        return False

    def vector_parameter(self, name: str, p: torch.Tensor) -> bool:
        """Whether ``name`` gets the exact curvature block ``[B]`` in Kronecker form, as a
        one-dimensional parameter does (``layers.kron.kron_factors``)."""
        return p.dim() == 1

    def check(self, module: nn.Module) -> Optional[str]:
        """Why per-sample quantities of ``module`` cannot be computed, or ``None`` if they can."""
        return None

    def batch_grad(self, call, name: str, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """``[N, *p.shape]``: the per-sample gradients ``g_n``."""
        raise NotImplementedError

    def batch_l2(self, call, name: str) -> Optional[torch.Tensor]:
        """``[N]``: ``||g_n||^2`` without materialising ``g_n``, or ``None``."""
        return None

    def sum_grad_squared(self, call, name: str) -> Optional[torch.Tensor]:
        """``p.shape``: ``sum_n g_n**2`` without materialising ``g_n``, or ``None``."""
        return None

    def column_grads(self, call, columns, name: str) -> torch.Tensor:
        """``[N, K, *p.shape]`` (sample-major): ``J_n^T v_nk`` for columns ``v`` (``[K, *out]``)
        at the output.

        Default: the columns as ``K * N`` pseudo-samples through :meth:`batch_grad`.
        """
        grads = self.expanded_batch_grad(call, columns, name)
        return grads.view(-1, call.batch_size, *grads.shape[1:]).transpose(0, 1)

    def expanded_batch_grad(self, call, columns, name: str) -> torch.Tensor:
        """``[K * N, *p.shape]`` (index ``k * N + n``): :meth:`batch_grad` of the call seen by
        the columns ``v`` (``[K, *out]``) as ``K * N`` pseudo-samples (``Call.expand``). A rule
        whose gradient of a parameter reads no input may skip repeating the inputs."""
        return self.batch_grad(call.expand(columns), name)

    def column_diag(self, call, columns, name: str, batched: bool) -> Optional[torch.Tensor]:
        """``sum_k (J_n^T v_nk)**2`` per sample (``batched``) or summed, without materialising
        ``[N, K, *p.shape]``, or ``None``."""
        return None

    def grad_sum(self, call, name: str) -> Optional[torch.Tensor]:
        """``p.shape``: ``sum_n g_n`` (this call's share of ``p.grad``), or ``None``."""
        return None

    def projected_sum(self, call, name: str, u, v) -> Optional[tuple]:
        """``sum_n g_n`` seen through random probes, from the per-row factors (inputs ``a_r``,
        output gradients ``b_r``, ``g_n = sum_{r in n} b_r a_rᵀ``) at ``O(R (I + O) K)``:
        ``(diag(uᵀ (sum_n g_n) v) = sum_r (b_rᵀ u)(a_rᵀ v)  [K],  sum_r |b_r| |a_r|  [])``
        for probes ``u [p.shape[0], K]``, ``v [p[0].numel(), K]`` (``p`` as a matrix); the
        second (Euclidean norms) sets the rounding bound. ``None``: use :meth:`grad_sum`."""
        return None

    # ------------------------------------------------------------ optional second-order hooks
    #: whether the module's output is linear in its input (or, ``PReLU``, piecewise linear in it
    #: and linear in its own leaf weight), so that ``DiagHessian`` needs no look inside it
    curvature_free: bool = False

    def kron_output_factor(
        self, call, columns, name: str, approx: str, n: int
    ) -> Optional[torch.Tensor]:
        """The output-side Kronecker factor of ``name`` (the one built from the columns, at
        :meth:`output_factor_index`) from one chunk of columns ``[K, *out]`` at the output
        (``n`` samples, ``approx`` "expand" or "reduce"; summed over the chunks), built with
        ``layers.kron``'s functions on the canonical weight-sharing format (inputs ``[N, P, I]``,
        columns ``[K, N, P, O]``, ``P`` positions sharing the weight), or ``None``: the exact
        block of a one-dimensional parameter, any other is unsupported. Raises
        ``UnsupportedKroneckerError`` where the parameter has no factorisation."""
        return None

    def kron_input_factor(self, call, name: str, approx: str, n: int) -> torch.Tensor:
        """The input-side factor of ``name`` (it does not depend on the columns: computed once
        per pass, from the call's inputs: its ``grad_out`` is ``None``), for a parameter whose
        :meth:`kron_output_factor` gives one."""
        raise NotImplementedError(
            f"{type(self).__name__} gives an output-side Kronecker factor of {name!r} but no "
            "kron_input_factor; implement both (docs/extending.md, the LayerRule table)"
        )

    def eigen_correction(self, call, name: str, bases) -> torch.Tensor:
        """``Σ_n (Q_0ᵀ G_n Q_1)²`` (``[dim Q_0, ·]``, see ``layers.kron``) of ``name``'s
        per-sample gradients ``G_n`` in the basis ``bases`` (``[Q_0, Q_1]``, ``[Q_0]`` or
        ``[]``), for ``EKFAC``. Default: :meth:`batch_grad` over chunks of samples, rotated
        (``layers.eigenbasis.eigen_moment_of``, :func:`moment_in_chunks`); a rule overrides it
        with ``layers.eigenbasis.eigen_moment`` on its canonical operands to avoid
        ``[N, *p.shape]``, or ``eigen_moment_of_vectors`` for a one-dimensional parameter shared
        over positions."""
        numel = call.module.get_parameter(name).numel()
        return moment_in_chunks(
            call, numel, lambda part: eigen_moment_of(self.batch_grad(part, name), bases)
        )

    def kron_groups(self, module: nn.Module, name: str) -> int:
        """``G``: the groups of ``name``'s entries that have separate Kronecker blocks, each
        factor stacked ``[G, d, d]`` (a grouped convolution's); 1 (default): one block."""
        return 1

    def output_factor_index(self, name: str) -> int:
        """Position of the output-side factor (:meth:`kron_output_factor`) in the list of
        factors (``[B, A]`` or ``[A, B]``)."""
        return 0

    #: optional, ``gradient_rows(call, name)``: ``(left [R, d_0], right [R, d])`` with
    #: ``leftᵀ right`` the gradient of ``name`` from this call as the matrix
    #: ``[p.shape[0], -1]`` (``R`` rows: samples times positions), or ``None`` for that
    #: parameter; a Kronecker step then applies ``(F_0⁻¹ leftᵀ)(F_1⁻¹ rightᵀ)ᵀ`` where that is
    #: cheaper (``optim.gradient_factors``). ``None``: the rule gives no rows
    gradient_rows: Optional[Callable] = None

    def has_weighted_squares(self, module: nn.Module) -> bool:
        """Whether :meth:`weighted_squares` applies to ``module`` (every parameter)."""
        return False

    def weighted_squares(
        self, module: nn.Module, x: torch.Tensor, r: torch.Tensor, name: str, batched: bool
    ) -> torch.Tensor:
        """The ``DiagHessian`` residual of a curved op applied right after the module:
        ``sum_j r_j (d u_j / d p)^2`` for the module's output ``u`` (input ``x``, weights ``r``
        shaped like ``u``), per sample (``batched``) or summed, without propagating columns."""
        raise NotImplementedError

    def kfra_weight(self, module: nn.Module) -> Optional[torch.Tensor]:
        """``W [O, I]`` of a layer ``h = W x (+ b)`` on inputs ``x [N, I]``, through which KFRA
        propagates ``B -> W^T B W`` (:meth:`kfra_factors` gives its factors), or ``None``:
        the module cannot be a link of a KFRA chain."""
        return None

    def kfra_factors(self, x: torch.Tensor, b: torch.Tensor, name: str) -> List[torch.Tensor]:
        """KFRA factors of ``name`` from the inputs ``x [N, I]`` and the propagated output-side
        factor ``b`` (``O x O``), output side first."""
        raise NotImplementedError


_guard(LayerRule)
