"""Errors in two sentences: what went wrong, naming the module by its path (and type), then the
fix; the details are in ``docs/support.md`` ("Errors and their fixes"), which the messages link
to. The same root cause gives the same message whatever the entry point, and
``collect(skip_unsupported=True)`` names each cause once, with the parameters it holds for."""

from __future__ import annotations

import re
import warnings
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as ext
from curvopt.errors import (
    MissingLossError,
    UnsupportedKroneckerError,
    UnsupportedLossError,
    UnsupportedModuleError,
)
from curvopt.losses import loss_rule_for

DT = torch.float64
ROOT = Path(__file__).resolve().parents[1]
LIMIT = 300  # characters


def sentences(message: str) -> int:
    """Sentence ends in ``message``: a ``.``, ``!`` or ``?`` before a space or the end, outside
    quotes and backticks (``'0.weight'``), not an ellipsis (``collect(..., x)``)."""
    bare = re.sub(r"'[^']*'|\"[^\"]*\"|`[^`]*`", "''", message)
    return len(re.findall(r"(?<!\.)[.!?](?=\s|$)", bare))


def check(message: str, *names: str) -> None:
    """At most two sentences, under ``LIMIT`` characters, naming each of ``names``."""
    assert sentences(message) <= 2, message
    assert len(message) < LIMIT, (len(message), message)
    for name in names:
        assert name in message, (name, message)


def raised(kind, run) -> str:
    with pytest.raises(kind) as info:
        run()
    return str(info.value)


def test_the_sentence_counter():
    assert sentences("One. Two; see docs/support.md#losses.") == 2
    assert sentences("module '0.weight' (Linear): x. Use collect(..., skip=True).") == 2
    assert sentences("A. B. C.") == 3


# ------------------------------------------------------------------------ one module, named
def _nested_embedding():
    torch.manual_seed(0)
    body = nn.Sequential(OrderedDict(emb=nn.Embedding(5, 3, scale_grad_by_freq=True)))
    return curvopt.extend(nn.Sequential(OrderedDict(body=body, head=nn.Linear(3, 2))).to(DT))


def test_an_unsupported_module_is_named_by_its_path_and_type():
    model = _nested_embedding()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())

    def run():
        with curvopt.collect(ext.BatchGrad()):
            lossfunc(model(torch.tensor([0, 1, 1, 4])), torch.tensor([0, 1, 0, 1])).backward()

    message = raised(UnsupportedModuleError, run)
    check(message, "'body.emb'", "(Embedding)", "scale_grad_by_freq", "Construct the Embedding")


def test_a_parameter_without_kronecker_factors_is_named_with_the_opt_in():
    torch.manual_seed(0)
    body = nn.Sequential(OrderedDict(up=nn.ConvTranspose2d(2, 4, 3)))
    model = curvopt.extend(
        nn.Sequential(OrderedDict(body=body, flat=nn.Flatten(), head=nn.Linear(144, 2))).to(DT)
    )
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())

    def run():
        with curvopt.collect(ext.KFLR()):
            lossfunc(model(torch.randn(3, 2, 4, 4, dtype=DT)), torch.tensor([0, 1, 0])).backward()

    message = raised(UnsupportedKroneckerError, run)
    check(message, "'body.up'", "(ConvTranspose2d)", "transposed", "skip_unsupported=True")
    assert "docs/support.md#no-kronecker-factors" in message


@pytest.mark.parametrize(
    "optimizer",
    [
        curvopt.optim.KFAC,
        curvopt.optim.EKFAC,
        curvopt.optim.DiagGGNNewton,
        curvopt.optim.VarianceAdaptedSGD,
    ],
)
def test_a_sparse_gradient_is_named_before_any_step(optimizer):
    """``nn.Embedding(sparse=True)`` gives a sparse ``p.grad``: each optimizer names the
    parameter and the dense option, where torch's own reshape or division error came out, and
    changes no parameter."""
    torch.manual_seed(0)
    body = nn.Sequential(OrderedDict(emb=nn.Embedding(10, 4, sparse=True)))
    model = curvopt.extend(
        nn.Sequential(OrderedDict(body=body, flat=nn.Flatten(), head=nn.Linear(12, 3))).to(DT)
    )
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randint(0, 10, (8, 3)), torch.randint(0, 3, (8,))
    opt = optimizer(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]

    def run():
        opt.zero_grad()
        with opt.collect():
            lossfunc(model(X), y).backward()
        opt.step()

    message = raised(TypeError, run)
    check(message, type(opt).__name__, "'body.emb.weight'", "sparse", "sparse=False")
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


# ------------------------------------------------------------------------------- the loss
@pytest.mark.parametrize("loss", [nn.CrossEntropyLoss, nn.MSELoss])
def test_reduction_none_says_the_same_wherever_it_is_met(loss):
    model = curvopt.extend(nn.Linear(3, 2).to(DT))
    lossfunc = curvopt.extend(loss(reduction="none"))
    X = torch.randn(4, 3, dtype=DT)
    y = torch.tensor([0, 1, 0, 1]) if loss is nn.CrossEntropyLoss else torch.randn(4, 2, dtype=DT)

    def run():
        with curvopt.collect(ext.DiagGGNExact()):
            lossfunc(model(X), y).sum().backward()

    message = raised(UnsupportedLossError, run)
    check(message, f"{loss.__name__}(reduction='none')", "reduction='mean'", "reduction='sum'")
    assert raised(UnsupportedLossError, lambda: loss_rule_for(loss(reduction="none"))) == message


def test_a_second_order_quantity_without_an_extended_loss_names_the_fix():
    model = curvopt.extend(nn.Linear(3, 2).to(DT))

    def run():
        with curvopt.collect(ext.DiagGGNExact()):
            model(torch.randn(4, 3, dtype=DT)).pow(2).mean().backward()

    message = raised(MissingLossError, run)
    check(message, "DiagGGNExact", "curvopt.extend(nn.CrossEntropyLoss())", "F.cross_entropy")
    assert "docs/support.md#missing-extended-loss" in message


@pytest.mark.parametrize("optimizer", ["KFAC", "EKFAC", "DiagGGNNewton"])
def test_an_unrecognised_loss_reached_from_an_optimizer_is_named_briefly(optimizer):
    """The extensions an optimizer collects are named by their class: ``optim.EKFAC``'s own
    (its supplied bases, a callable) never reach the message."""
    model = curvopt.extend(nn.Linear(3, 2).to(DT))
    opt = getattr(curvopt.optim, optimizer)(model.parameters(), lr=0.1, damping=1e-2)
    X, y = torch.randn(4, 3, dtype=DT), torch.randn(4, 2, dtype=DT)

    def run():
        F.l1_loss(model(X), y).backward()
        opt.step()

    message = raised(MissingLossError, run)
    check(message, "curvopt.extend(nn.CrossEntropyLoss())", "F.cross_entropy")
    assert " at 0x" not in message and "<function" not in message


# ------------------------------------------------------------ one cause, one message
def _batchnorm_model():
    torch.manual_seed(0)
    block = nn.Sequential(OrderedDict(bn=nn.BatchNorm2d(3)))
    return curvopt.extend(
        nn.Sequential(
            OrderedDict(
                conv=nn.Conv2d(2, 3, 3, padding=1), block=block, act=nn.ReLU(),
                flat=nn.Flatten(), head=nn.Linear(48, 3),
            )
        ).to(DT)
    )  # fmt: skip


def _batchnorm_message(make, functional: bool) -> str:
    model = _batchnorm_model()
    X, y = torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())

    def run():
        with curvopt.collect(make()):
            out = model(X)
            (F.cross_entropy(out, y) if functional else lossfunc(out, y)).backward()

    return raised(UnsupportedModuleError, run)


def test_batchnorm_in_training_mode_gives_one_message_whatever_the_entry_point():
    """An extended loss module or a functional loss, a per-sample quantity or a curvature not
    made in a coupled pass: the same message, naming the module and both fixes."""
    messages = {
        (make.__name__, functional): _batchnorm_message(make, functional)
        for make in (ext.BatchGrad, ext.BatchDiagGGNExact, ext.KFRA)
        for functional in (False, True)
    }
    assert len(set(messages.values())) == 1, messages
    (message,) = set(messages.values())
    check(message, "'block.bn'", "(BatchNorm2d)", "statistics of the whole batch")
    assert "model.eval()" in message and "Monte-Carlo" in message
    assert "docs/support.md#batchnorm-in-training-mode" in message


@pytest.mark.parametrize(
    "make, curvature, monte_carlo",
    [(curvopt.optim.KFAC, "kfra", "kfac")],
)
@pytest.mark.parametrize("collection", ["auto", "explicit"])
def test_batchnorm_reached_from_an_optimizer_names_its_argument(
    make, curvature, monte_carlo, collection
):
    """KFRA through BatchNorm in training mode, asked for by an optimizer (armed or
    in ``opt.collect()``): the fix is the optimizer's ``curvature=`` argument, not an
    extension class; the error is raised by the backward pass, as from ``collect``."""
    model = _batchnorm_model()
    X, y = torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = make(model.parameters(), lr=0.1, curvature=curvature, collection=collection)

    def run():
        loss = lossfunc(model(X), y)
        with opt.collect():
            loss.backward()

    message = raised(UnsupportedModuleError, run)
    name = make.__name__
    check(message, "'block.bn'", "(BatchNorm2d)", "statistics of the whole batch", "model.eval()")
    assert f"{name}(..., curvature={monte_carlo!r})" in message
    assert "DiagGGNMC" not in message and "KFAC)" not in message
    assert message.endswith("see docs/support.md#batchnorm-in-training-mode.")
    # the same model through curvopt.collect keeps the extension classes
    assert "(DiagGGNMC, KFAC)" in _batchnorm_message(ext.KFRA, functional=False)


def test_batchnorm_from_an_optimizer_then_from_collect_each_in_its_terms():
    """The optimizer's phrasing is its own: a ``collect`` block opened afterwards (the
    optimizer disarmed by ``collection="explicit"``) names the extensions again."""
    model = _batchnorm_model()
    X, y = torch.randn(5, 2, 4, 4, dtype=DT), torch.randint(0, 3, (5,))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = curvopt.optim.KFAC(model.parameters(), lr=0.1, curvature="kfra")
    message = raised(UnsupportedModuleError, lambda: lossfunc(model(X), y).backward())
    assert "KFAC(..., curvature='kfac')" in message
    del opt

    def run():
        with curvopt.collect(ext.KFRA()):
            lossfunc(model(X), y).backward()

    assert "(DiagGGNMC, KFAC)" in raised(UnsupportedModuleError, run)


@pytest.mark.parametrize("make", [curvopt.optim.KFAC, curvopt.optim.DiagGGNNewton])
def test_an_l2_penalty_in_the_loss_suggests_weight_decay(make):
    """An L2 penalty added to the loss is refused, with the optimizer's ``weight_decay=`` as
    the fix."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 3)).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randn(8, 4, dtype=DT), torch.randint(0, 3, (8,))
    opt = make(model.parameters(), lr=0.1)

    def run():
        penalty = 1e-2 * sum(p.pow(2).sum() for p in model.parameters())
        (lossfunc(model(X), y) + penalty).backward()
        opt.step()

    message = raised(UnsupportedModuleError, run)
    check(message, "receives gradient from outside", "weight_decay=")
    assert "docs/support.md#gradient-from-other-terms" in message


@pytest.mark.parametrize(
    "options, expected",
    [
        (
            {"lr": "0.05"},
            "lr must be a finite number (float or int) >= 0.0, got '0.05' of type str",
        ),
        (
            {"lr": 0.1, "momentum": 1.0},
            "momentum must be a finite number (float or int) >= 0.0 and < 1.0, got 1.0 of "
            "type float",
        ),
        (
            {"lr": 0.1, "mc_samples": 2.0},
            "mc_samples must be an int >= 1, got 2.0 of type float",
        ),
        ({"lr": True}, "lr must be a finite number (float or int) >= 0.0, got True of type bool"),
        (
            {"lr": 0.1, "damping": "1e-3"},
            "damping must be a number >= 0, a callable of the step count or a damping strategy "
            "(ConstantDamping, ScheduledDamping, LevenbergMarquardt, RelativeDamping, "
            "ReductionScaledDamping), got '1e-3' of type str",
        ),
        (
            {"lr": 0.1, "damping": -1.0},
            "damping must be a finite number (float or int) >= 0, got -1.0 of type float",
        ),
    ],
)
def test_a_number_of_the_wrong_type_names_the_type_expected_and_given(options, expected):
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError) as info:
        curvopt.optim.KFAC(params, **options)
    assert str(info.value) == expected


class _SequenceFirst(nn.Module):
    """Embedding and MultiheadAttention on ``[T, N]`` tokens, batch_first=False: the
    Embedding's batch dim reads as 0, the attention's as 1."""

    def __init__(self, vocab=7, d=4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.att = nn.MultiheadAttention(d, 1)
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens):
        h = self.emb(tokens)
        a, _ = self.att(h, h, h)
        return self.head(h + a)


class _Folded(nn.Module):
    """A batch ``[N, 2, 4]`` folded into ``[2 N, 4]`` between two layers."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(self.a(x).reshape(-1, 4))


def _generic(message: str) -> str:
    """``message`` without what differs between two models: paths, types and sizes."""
    message = re.sub(r"module '[^']*' \(\w+\)", "module", message)
    return re.sub(r"\d+", "#", message)


def test_a_batch_without_a_consistent_size_says_the_same_from_both_checks():
    """A sequence-first model with a plain loss (the batch read off the modules alone) and a
    folded batch with an extended loss (read off the loss's rows): one message, the module's
    path and both fixes."""
    torch.manual_seed(0)
    model = curvopt.extend(_SequenceFirst().to(DT))
    tokens = torch.randint(0, 7, (5, 3))  # [T, N]

    def plain():
        with curvopt.collect(ext.BatchGrad()):
            out = model(tokens).reshape(-1, 7)
            nn.CrossEntropyLoss()(out, torch.randint(0, 7, (15,))).backward()

    sequence_first = raised(UnsupportedModuleError, plain)
    check(sequence_first, "'att'", "(MultiheadAttention)", "sequence_first=True", "extend")
    assert "docs/support.md#the-batch-dimension" in sequence_first

    folded = curvopt.extend(_Folded().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())

    def extended():
        with curvopt.collect(ext.BatchGrad()):
            x = torch.randn(3, 2, 4, dtype=DT)
            lossfunc(folded(x), torch.randint(0, 2, (6,))).backward()

    from_rows = raised(UnsupportedModuleError, extended)
    check(from_rows, "'b'", "(Linear)", "sequence_first=True")
    assert _generic(from_rows) == _generic(sequence_first)


# ---------------------------------------------------------------- skip_unsupported: each cause once
class _Scale(nn.Module):
    """A raw 4-D parameter: no Kronecker factorisation."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(1, 4, 1, 1))

    def forward(self, x):
        return x * self.w


def _skipping_model():
    torch.manual_seed(0)
    return curvopt.extend(
        nn.Sequential(
            OrderedDict(
                c1=nn.ConvTranspose2d(2, 4, 3, padding=1), c2=nn.ConvTranspose2d(4, 4, 1),
                scale=_Scale(), flat=nn.Flatten(), head=nn.Linear(64, 3),
            )
        ).to(DT)
    )  # fmt: skip


@pytest.mark.parametrize("skip", [True, "diagonal"])
def test_skipped_names_each_cause_once_with_its_parameters(skip):
    model = _skipping_model()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    X, y = torch.randn(3, 2, 4, 4, dtype=DT), torch.tensor([0, 1, 2])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with curvopt.collect(ext.KFLR(), skip_unsupported=skip) as ctx:
            lossfunc(model(X), y).backward()
    assert set(ctx.skipped) == {"c1.weight", "c2.weight", "scale.w"}
    grouped = ctx.skipped["c1.weight"]
    assert ctx.skipped["c2.weight"] == grouped and "transposed" in grouped
    assert ctx.skipped["scale.w"] != grouped and "_Scale" in ctx.skipped["scale.w"]
    for cause in ctx.skipped.values():  # a short cause, no name or path, no fix
        assert sentences(cause) == 0 and len(cause) < 100, cause
        assert not any(name in cause for name in ("c1", "c2", "scale.w", "'w'")), cause
    (warning,) = [str(w.message) for w in caught if "skip_unsupported" in str(w.message)]
    assert sentences(warning) <= 2, warning
    for cause in set(ctx.skipped.values()):
        assert warning.count(cause) == 1, (cause, warning)
    for name in ctx.skipped:
        assert warning.count(f"'{name}'") == 1, (name, warning)
    assert re.search(r"'c1\.weight', 'c2\.weight' \(ConvTranspose2d: transposed", warning), warning
    assert "fallback='diagonal'" in warning


# ------------------------------------------------------------- every link names a section
def _slug(heading: str) -> str:
    """The anchor of a Markdown heading (GitHub's and myst's ``myst_heading_anchors``)."""
    text = re.sub(r"[^\w\s-]", "", heading.strip().lower())
    return re.sub(r"\s", "-", text)


def test_every_docs_link_of_a_message_names_a_section():
    anchors = {
        _slug(line.lstrip("#"))
        for line in (ROOT / "docs" / "support.md").read_text().splitlines()
        if line.startswith("#")
    }
    assert "errors-and-their-fixes" in anchors and "batchnorm-in-training-mode" in anchors
    sources = [ROOT / "curvopt" / "errors.py"]
    for folder in (
        "core",
        "graph",
        "engine",
        "guards",
        "loop",
        "entry",
        "frontend",
        "layers",
        "losses",
    ):
        sources += sorted((ROOT / "curvopt" / folder).glob("*.py"))
    linked = {}
    for path in sources:
        for anchor in re.findall(r"docs/support\.md#([\w-]+)", path.read_text()):
            linked.setdefault(anchor, path.relative_to(ROOT).as_posix())
    assert len(linked) >= 10, linked
    missing = {a: where for a, where in linked.items() if a not in anchors}
    assert not missing, missing
