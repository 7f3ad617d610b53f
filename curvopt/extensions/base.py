"""Base class of the quantities ``collect`` computes."""

from __future__ import annotations

from typing import Any, ClassVar, Dict, Optional, Tuple, Type

from curvopt.extensions.quantity import Quantity, declare


class Extension:
    """Base class of a quantity written as ``p.<attr>`` on every parameter that requires grad.

    A subclass declares it once, ``quantity = Quantity(attr, kind, combine, producer)``;
    ``attr`` and ``order`` (1 for quantities built from per-sample gradients, 2 for
    curvature, which needs a loss curvopt can read) follow from it. ``options`` are the
    constructor arguments; two extensions writing the same attribute in one ``collect`` must
    agree on them (``key()``), else ``collect`` raises ``ExtensionConflictError``.

    Args:
        **options: the quantity's settings (``mc_samples``, ``kfac_approx``, ...), kept in
            ``self.options`` and shown by ``repr``.

    Raises:
        TypeError: (when subclassing) ``quantity`` is not a :class:`Quantity`, or ``attr`` is
            set without a declaration.

    Example:
        >>> from curvopt import extensions as ext
        >>> ext.KFAC(mc_samples=2)
        KFAC(mc_samples=2, kfac_approx='expand')
        >>> ext.KFAC.attr, ext.KFAC.order, ext.BatchGrad.order
        ('kfac', 2, 1)
    """

    quantity: ClassVar[Quantity]
    attr: ClassVar[str] = ""
    order: ClassVar[int] = 1
    #: which loss-Hessian square root a curvature quantity propagates: "exact", "mc"
    #: (Monte-Carlo, ``mc_samples`` columns) or "empirical" (one column, the loss gradient at
    #: the observed targets); None for first-order quantities
    source: ClassVar[Optional[str]] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        q = cls.__dict__.get("quantity")
        if q is None:
            if "attr" in cls.__dict__:
                raise TypeError(
                    f"{cls.__name__} sets attr without a declaration; declare the quantity as "
                    "quantity = curvopt.extensions.Quantity(attr, kind, combine, producer)"
                )
            return
        if not isinstance(q, Quantity):
            raise TypeError(f"{cls.__name__}.quantity must be a Quantity, got {q!r}")
        cls.attr = q.attr
        cls.order = q.producer.order
        declare(q)
        _WRITERS.setdefault(q.attr, cls)  # the first declaration writing it (the shipped one)

    def __init__(self, **options: Any):
        self.options: Dict[str, Any] = options

    def key(self) -> Tuple[Any, ...]:
        return (type(self).__name__, tuple(sorted(self.options.items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.options.items())
        return f"{type(self).__name__}({args})"


_WRITERS: Dict[str, Type[Extension]] = {}


def writer(attr: str) -> Type[Extension]:
    """The extension class that writes ``p.<attr>``.

    The one lookup by attribute name that ``optim``, ``linalg`` and ``experiments`` use.

    Args:
        attr: the attribute name (``"kfac"``, ``"diag_ggn_mc"``, ``"grad_batch"``, ...).

    Returns:
        The :class:`Extension` subclass that declared ``attr`` first (the shipped one).

    Raises:
        KeyError: no extension writes ``p.<attr>`` (the message lists the known ones).

    Example:
        >>> from curvopt import extensions as ext
        >>> ext.writer("grad_batch") is ext.BatchGrad
        True
    """
    try:
        return _WRITERS[attr]
    except KeyError:
        raise KeyError(
            f"curvopt: no extension writes p.{attr}; known: {', '.join(sorted(_WRITERS))}"
        ) from None


def extension(attr: str, mc_samples: int = 1, **options: Any) -> Extension:
    """An instance of the extension writing ``p.<attr>``, built with ``options``.

    Args:
        attr: the attribute name, as for :func:`writer`.
        mc_samples: passed on only to a Monte-Carlo extension (``source == "mc"``:
            ``DiagGGNMC``, ``BatchDiagGGNMC``, ``KFAC``); the others do not take it.
        **options: the extension's other constructor arguments.

    Returns:
        The :class:`Extension` instance.

    Raises:
        KeyError: no extension writes ``p.<attr>``.

    Example:
        >>> from curvopt import extensions as ext
        >>> ext.extension("diag_ggn_mc", mc_samples=2)
        DiagGGNMC(mc_samples=2)
        >>> ext.extension("diag_ggn_exact", mc_samples=2)
        DiagGGNExact()
    """
    cls = writer(attr)
    if cls.source == "mc":
        options["mc_samples"] = mc_samples
    return cls(**options)
