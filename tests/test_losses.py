"""Tests of ``curvopt.losses``: loss-Hessian square roots against ``torch.func.hessian``.

The reference differentiates the loss module's own forward twice w.r.t. its input, so every
option (reduction, weights, ignore_index, label smoothing, soft targets, pos_weight) is checked
against what torch actually computes.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from curvopt.errors import UnsupportedLossError
from curvopt.losses import LossRule, loss_rule_for
from curvopt.losses.cross_entropy import _sample_classes

torch.set_num_threads(1)
# torch.func.hessian (the reference) uses torch.jit.script internally
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)
DT = torch.float64
C = 4  # classes of the cross-entropy cases


# ----------------------------------------------------------------------------- helpers


def reference_blocks(loss_module, output, target):
    """Per-sample Hessian blocks ``[N, P, P]``; asserts the cross-sample blocks vanish."""
    n, p = output.shape[0], output[0].numel()
    hess = torch.func.hessian(lambda x: loss_module(x, target))(output).reshape(n, p, n, p)
    blocks = torch.stack([hess[i, :, i] for i in range(n)])
    off_diagonal = hess.clone()
    for i in range(n):
        off_diagonal[i, :, i] = 0
    assert off_diagonal.abs().max() == 0
    return blocks


def gram(factor):
    """``sum_k s_k s_k^T`` per sample, ``[N, P, P]``, for a factor ``[K, N, *F]``."""
    s = factor.reshape(factor.shape[0], factor.shape[1], -1)
    return torch.einsum("knp,knq->npq", s, s)


def ce_case(n, tail, option, reduction, seed=0):
    """Cross-entropy module, logits ``[n, C, *tail]`` and target for ``+``-joined options."""
    option = set(option.split("+"))
    gen = torch.Generator().manual_seed(seed)
    output = 2 * torch.randn(n, C, *tail, generator=gen, dtype=DT)
    kwargs = {"reduction": reduction}
    if "weight" in option:
        kwargs["weight"] = torch.rand(C, generator=gen, dtype=DT) + 0.1
    if "smooth" in option:
        kwargs["label_smoothing"] = 0.2
    if "soft" in option:
        target = torch.rand(n, C, *tail, generator=gen, dtype=DT)
        if "unnormalised" not in option:
            target = target / target.sum(1, keepdim=True)
    else:
        target = torch.randint(0, C, (n, *tail), generator=gen)
        if "ignore" in option:  # default ignore_index -100 on every third position
            target.view(-1)[1::3] = -100
        if "custom-ignore" in option:  # a valid class index as ignore_index
            kwargs["ignore_index"] = 2
            target.view(-1)[0] = 0
    return nn.CrossEntropyLoss(**kwargs), output, target


def mse_case(n, tail, reduction, seed=0):
    gen = torch.Generator().manual_seed(seed)
    output = torch.randn(n, *tail, generator=gen, dtype=DT)
    return nn.MSELoss(reduction=reduction), output, torch.randn(n, *tail, generator=gen, dtype=DT)


def bce_case(n, tail, option, reduction, seed=0):
    option = set(option.split("+"))
    gen = torch.Generator().manual_seed(seed)
    output = 2 * torch.randn(n, *tail, generator=gen, dtype=DT)
    target = torch.randint(0, 2, (n, *tail), generator=gen).to(DT)
    kwargs = {"reduction": reduction}
    if "weight-last" in option:
        kwargs["weight"] = torch.rand(tail[-1], generator=gen, dtype=DT) + 0.1
    if "weight-full" in option:
        kwargs["weight"] = torch.rand(n, *tail, generator=gen, dtype=DT)
    if "pos_weight" in option:
        kwargs["pos_weight"] = 3 * torch.rand(tail[-1], generator=gen, dtype=DT)
    if "soft" in option:
        target = torch.rand(n, *tail, generator=gen, dtype=DT)
    return nn.BCEWithLogitsLoss(**kwargs), output, target


CE_OPTIONS = [
    "plain",
    "weight",
    "ignore",
    "custom-ignore",
    "smooth",
    "weight+ignore+smooth",
    "soft",
    "soft+weight+smooth",
    "soft+unnormalised",
    "soft+unnormalised+weight",
]
BCE_OPTIONS = ["plain", "weight-last", "weight-full", "pos_weight", "pos_weight+weight-last+soft"]
REDUCTIONS = ["sum", "mean"]
NS = [1, 3]

CASES = (
    [
        pytest.param(ce_case, (n, tail, opt, red), id=f"CE-{n}x{C}x{tail}-{opt}-{red}")
        for n in NS
        for tail in [(), (4,), (2, 3)]
        for opt in CE_OPTIONS
        for red in REDUCTIONS
    ]
    + [
        pytest.param(mse_case, (n, tail, red), id=f"MSE-{n}x{tail}-{red}")
        for n in NS
        for tail in [(), (5,), (2, 3)]
        for red in REDUCTIONS
    ]
    + [
        pytest.param(bce_case, (n, tail, opt, red), id=f"BCE-{n}x{tail}-{opt}-{red}")
        for n in NS
        for tail in [(5,), (2, 2)]
        for opt in BCE_OPTIONS
        for red in REDUCTIONS
    ]
)


# ----------------------------------------------------------------------------- exact factor


@pytest.mark.parametrize(("make", "args"), CASES)
def test_exact_factor_matches_hessian(make, args):
    loss, output, target = make(*args)
    rule = loss_rule_for(loss)
    rule.check(loss, output, target)
    factor = rule.sqrt_hessian(loss, output, target)
    assert factor.shape == (rule.num_columns(loss, output), *output.shape)
    assert factor.dtype == DT
    torch.testing.assert_close(gram(factor), reference_blocks(loss, output, target))


@pytest.mark.parametrize(
    ("loss", "shape", "expected"),
    [
        (nn.CrossEntropyLoss(), (3, 5), 5),
        (nn.CrossEntropyLoss(), (3, 5, 2, 3), 30),
        (nn.MSELoss(), (3,), 1),
        (nn.MSELoss(), (3, 2, 3), 6),
        (nn.BCEWithLogitsLoss(), (3, 2, 2), 4),
    ],
)
def test_num_columns(loss, shape, expected):
    assert loss_rule_for(loss).num_columns(loss, torch.zeros(shape)) == expected


@pytest.mark.parametrize(
    ("make", "args"),
    [
        (ce_case, (3, (2, 3), "weight+ignore+smooth", "mean")),
        (ce_case, (2, (), "soft", "sum")),
        (mse_case, (3, (2, 3), "mean")),
        (bce_case, (3, (2, 2), "pos_weight+weight-last+soft", "sum")),
    ],
)
def test_column_chunks_are_rows_of_full_factor(make, args):
    loss, output, target = make(*args)
    rule = loss_rule_for(loss)
    full = rule.sqrt_hessian(loss, output, target)
    k = rule.num_columns(loss, output)
    chunks = [
        rule.sqrt_hessian(loss, output, target, columns=range(a, min(a + 5, k)))
        for a in range(0, k, 5)
    ]
    assert torch.equal(torch.cat(chunks), full)
    assert torch.equal(
        rule.sqrt_hessian(loss, output, target, columns=slice(1, None, 2)), full[1::2]
    )
    backwards = range(k - 1, 0, -3)
    assert torch.equal(
        rule.sqrt_hessian(loss, output, target, columns=backwards), full[list(backwards)]
    )
    assert rule.sqrt_hessian(loss, output, target, columns=range(2, 2)).shape == (0, *output.shape)


def test_label_smoothing_leaves_unweighted_hessian_unchanged():
    loss, output, target = ce_case(3, (4,), "plain", "mean")
    smooth = nn.CrossEntropyLoss(label_smoothing=0.3)
    torch.testing.assert_close(
        reference_blocks(smooth, output, target), reference_blocks(loss, output, target)
    )
    rule = loss_rule_for(loss)
    torch.testing.assert_close(
        rule.sqrt_hessian(smooth, output, target), rule.sqrt_hessian(loss, output, target)
    )


def test_extreme_logits_give_finite_exact_factors():
    output = torch.tensor([[800.0, -800.0, 0.0], [30.0, -30.0, 1.0]], dtype=DT)
    for loss, target in [
        (nn.CrossEntropyLoss(), torch.tensor([1, 0])),
        (nn.BCEWithLogitsLoss(pos_weight=torch.full((3,), 2.0, dtype=DT)), torch.ones_like(output)),
    ]:
        factor = loss_rule_for(loss).sqrt_hessian(loss, output, target)
        assert torch.isfinite(factor).all()
        torch.testing.assert_close(gram(factor), reference_blocks(loss, output, target))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_low_precision_outputs_keep_their_dtype(dtype):
    for make, args in [
        (ce_case, (3, (2,), "weight+ignore+smooth", "mean")),
        (mse_case, (3, (2,), "sum")),
        (bce_case, (3, (2,), "pos_weight+weight-last+soft", "mean")),
    ]:
        loss64, output, target = make(*args)
        loss = loss64.to(dtype)
        low = output.to(dtype)
        target = target.to(dtype) if target.is_floating_point() else target
        rule = loss_rule_for(loss)
        exact = rule.sqrt_hessian(loss, low, target)
        assert exact.dtype == dtype
        assert rule.sqrt_hessian_mc(loss, low, target, 2).dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 3e-2
        torch.testing.assert_close(
            gram(exact.to(DT)), gram(rule.sqrt_hessian(loss64, output, target)), atol=tol, rtol=tol
        )


@settings(max_examples=40, deadline=None)
@given(
    loss_kind=st.sampled_from(["ce", "ce-soft", "mse", "bce"]),
    n=st.integers(1, 3),
    num_classes=st.integers(1, 4),
    tail=st.lists(st.integers(1, 3), max_size=2),
    weighted=st.booleans(),
    smoothing=st.sampled_from([0.0, 0.1, 1.0]),
    reduction=st.sampled_from(REDUCTIONS),
    seed=st.integers(0, 2**16),
)
def test_exact_factor_property_sweep(
    loss_kind, n, num_classes, tail, weighted, smoothing, reduction, seed
):
    gen = torch.Generator().manual_seed(seed)
    if loss_kind.startswith("ce"):
        shape = (n, num_classes, *tail)
        weight = torch.rand(num_classes, generator=gen, dtype=DT) if weighted else None
        loss = nn.CrossEntropyLoss(weight=weight, label_smoothing=smoothing, reduction=reduction)
        if loss_kind == "ce-soft":
            target = torch.rand(shape, generator=gen, dtype=DT).softmax(1)
        else:
            target = torch.randint(0, num_classes, (n, *tail), generator=gen)
            target.view(-1)[1::2] = -100
    else:
        shape = (n, *tail)
        target = torch.rand(shape, generator=gen, dtype=DT)
        if loss_kind == "mse":
            loss = nn.MSELoss(reduction=reduction)
        else:
            weight = torch.rand(shape, generator=gen, dtype=DT) if weighted else None
            pos_weight = torch.rand(shape[-1:], generator=gen, dtype=DT) * 2 if smoothing else None
            loss = nn.BCEWithLogitsLoss(weight=weight, pos_weight=pos_weight, reduction=reduction)
    output = 3 * torch.randn(shape, generator=gen, dtype=DT)
    if loss_kind == "ce" and reduction == "mean" and weighted:
        loss.weight[target.view(-1)[0]] += 0.1  # nonzero normaliser
    factor = loss_rule_for(loss).sqrt_hessian(loss, output, target)
    torch.testing.assert_close(gram(factor), reference_blocks(loss, output, target))


# ----------------------------------------------------------------------------- Monte-Carlo


MC_CASES = [
    pytest.param(ce_case, (3, (2, 3), "weight+custom-ignore+smooth", "mean"), id="CE-spatial"),
    pytest.param(ce_case, (2, (), "soft+unnormalised+weight", "sum"), id="CE-soft"),
    pytest.param(mse_case, (3, (2, 3), "mean"), id="MSE"),
    pytest.param(bce_case, (3, (2, 2), "pos_weight+weight-full+soft", "sum"), id="BCE-pos_weight"),
    pytest.param(bce_case, (2, (3,), "weight-last", "mean"), id="BCE"),
]


@pytest.mark.parametrize(("make", "args"), MC_CASES)
def test_mc_factor_is_unbiased(make, args):
    """``sum_m s_m s_m^T`` is a mean of M i.i.d. terms; it must be within 5 standard errors.

    Logits are scaled down so that every outcome has probability > 5%: with rarer outcomes the
    sampled standard error misses unobserved coincidences and the bound is unreliable.
    """
    loss, output, target = make(*args)
    output = output / 4
    exact = reference_blocks(loss, output, target)
    mc = 20_000
    torch.manual_seed(0)
    factor = loss_rule_for(loss).sqrt_hessian_mc(loss, output, target, mc)
    assert factor.shape == (mc, *output.shape)
    s = factor.reshape(mc, output.shape[0], -1)
    estimate = torch.einsum("mnp,mnq->npq", s, s)
    second_moment = mc * torch.einsum("mnp,mnq->npq", s**2, s**2)
    std_error = ((second_moment - estimate**2).clamp(min=0) / mc).sqrt()
    assert (estimate - exact).abs().le(5 * std_error + 1e-12).all()
    # the bound is tight enough to catch a 5% scale error
    assert not (1.05 * estimate - exact).abs().le(5 * std_error + 1e-12).all()


@pytest.mark.parametrize(("make", "args"), MC_CASES)
def test_mc_factor_is_reproducible_under_manual_seed(make, args):
    loss, output, target = make(*args)
    rule = loss_rule_for(loss)
    draws = []
    for seed in (1, 1, 2):
        torch.manual_seed(seed)
        draws.append(rule.sqrt_hessian_mc(loss, output, target, 3))
    assert torch.equal(draws[0], draws[1])
    assert not torch.equal(draws[0], draws[2])


# ----------------------------------------------------------------------------- errors


def test_unknown_loss_is_rejected_with_the_fix():
    with pytest.raises(UnsupportedLossError, match=r"L1Loss.*register_loss_rule"):
        loss_rule_for(nn.L1Loss())
    with pytest.raises(UnsupportedLossError, match="NLLLoss"):
        loss_rule_for(nn.NLLLoss())


def test_subclass_uses_base_rule_unless_it_overrides_forward():
    class Tagged(nn.MSELoss):
        pass

    class Doubled(nn.MSELoss):
        def forward(self, input, target):
            return 2 * super().forward(input, target)

    assert loss_rule_for(Tagged()) is loss_rule_for(nn.MSELoss())
    with pytest.raises(UnsupportedLossError, match=r"Doubled.*overrides MSELoss.forward"):
        loss_rule_for(Doubled())


@pytest.mark.parametrize("loss_cls", [nn.CrossEntropyLoss, nn.MSELoss, nn.BCEWithLogitsLoss])
def test_reduction_none_is_rejected(loss_cls):
    with pytest.raises(UnsupportedLossError, match=r"reduction='none'.*'mean'.*'sum'"):
        loss_rule_for(loss_cls(reduction="none"))


@pytest.mark.parametrize(
    "loss",
    [
        nn.CrossEntropyLoss(weight=torch.tensor([1.0, -1.0])),
        nn.BCEWithLogitsLoss(weight=torch.tensor([1.0, -1.0])),
        nn.BCEWithLogitsLoss(pos_weight=torch.tensor([-1.0])),
    ],
)
def test_negative_weights_are_rejected(loss):
    with pytest.raises(UnsupportedLossError, match="negative"):
        loss_rule_for(loss)


def test_options_changed_after_lookup_are_rechecked():
    loss = nn.MSELoss()
    rule = loss_rule_for(loss)
    loss.reduction = "none"
    with pytest.raises(UnsupportedLossError, match="reduction='none'"):
        rule.sqrt_hessian(loss, torch.zeros(2, 3), torch.zeros(2, 3))


X = torch.zeros(2, 3, dtype=DT)
BAD_INPUTS = [
    (nn.MSELoss(), X.long(), X, ValueError, "floating-point"),
    (nn.MSELoss(), X[0, 0], X[0, 0], ValueError, "batch dimension"),
    (nn.MSELoss(), X[:0], X[:0], ValueError, "at least one element"),
    (nn.MSELoss(), X.clone().fill_(math.inf), X, ValueError, "inf or nan"),
    (nn.MSELoss(), X.tolist(), X, TypeError, "must be a tensor"),
    (nn.MSELoss(), X, X.tolist(), TypeError, "must be a tensor"),
    (nn.MSELoss(), X, X[:, :1], ValueError, "broadcasting"),
    (nn.BCEWithLogitsLoss(), X, X[0], ValueError, "target shape"),
    (nn.BCEWithLogitsLoss(weight=torch.ones(2)), X, X, ValueError, "does not broadcast"),
    (nn.BCEWithLogitsLoss(pos_weight=torch.ones(3)), X, X + 2, ValueError, r"\[0, 1\]"),
    (nn.CrossEntropyLoss(), X[0], torch.tensor(1), ValueError, "unsqueeze"),
    (nn.CrossEntropyLoss(), X, torch.tensor([0, 1, 2]), ValueError, r"shape \(2,\)"),
    (nn.CrossEntropyLoss(), X, torch.tensor([0, 3]), ValueError, r"\[0, 3\)"),
    (nn.CrossEntropyLoss(), X, torch.tensor([-1, 0]), ValueError, r"\[0, 3\)"),
    (nn.CrossEntropyLoss(), X, torch.tensor([True, False]), ValueError, "class indices"),
    (nn.CrossEntropyLoss(), X, X[:, :2], ValueError, "probability targets"),
    (nn.CrossEntropyLoss(ignore_index=0), X, X, ValueError, "ignore_index"),
    (nn.CrossEntropyLoss(), X, torch.tensor([-100, -100]), ValueError, "0/0"),
    (
        nn.CrossEntropyLoss(weight=torch.tensor([0.0, 1.0, 1.0], dtype=DT)),
        X,
        torch.tensor([0, -100]),
        ValueError,
        "zero class weight",
    ),
    (nn.CrossEntropyLoss(), X, -torch.ones_like(X), UnsupportedLossError, "no square root"),
    # indices in range, which proves the normaliser only without class weights and with
    # ignore_index outside [0, C): the normaliser is still checked where either fails
    (nn.CrossEntropyLoss(ignore_index=1), X, torch.tensor([1, 1]), ValueError, "0/0"),
    (
        nn.CrossEntropyLoss(weight=torch.tensor([0.0, 1.0, 1.0], dtype=DT)),
        X,
        torch.tensor([0, 0]),
        ValueError,
        "zero class weight",
    ),
]


@pytest.mark.parametrize(("loss", "output", "target", "error", "match"), BAD_INPUTS)
def test_bad_inputs_are_rejected_by_every_entry_point(loss, output, target, error, match):
    rule = loss_rule_for(loss)
    with pytest.raises(error, match=match):
        rule.check(loss, output, target)
    with pytest.raises(error, match=match):
        rule.sqrt_hessian(loss, output, target)
    with pytest.raises(error, match=match):
        rule.sqrt_hessian_mc(loss, output, target, 1)


def test_all_ignored_is_fine_with_sum_reduction():
    loss = nn.CrossEntropyLoss(reduction="sum")
    factor = loss_rule_for(loss).sqrt_hessian(loss, X, torch.tensor([-100, -100]))
    assert not factor.any()
    # one position: its divisor 1 equals the count of positions, yet it counts nothing
    factor = loss_rule_for(loss).sqrt_hessian(loss, X[:1], torch.tensor([-100]))
    assert not factor.any()


@pytest.mark.parametrize(
    ("columns", "error", "match"),
    [
        (range(7), ValueError, "out of bounds"),
        (range(-1, 2), ValueError, "out of bounds"),
        ([0, 1], TypeError, "range or a slice"),
    ],
)
def test_bad_columns_are_rejected(columns, error, match):
    loss = nn.MSELoss()
    with pytest.raises(error, match=match):
        loss_rule_for(loss).sqrt_hessian(loss, X, X, columns=columns)


@pytest.mark.parametrize("mc_samples", [0, -1, 1.5, True])
def test_bad_mc_samples_are_rejected(mc_samples):
    loss = nn.MSELoss()
    with pytest.raises(ValueError, match="positive int"):
        loss_rule_for(loss).sqrt_hessian_mc(loss, X, X, mc_samples)


def test_rules_are_loss_rules():
    for loss in (nn.CrossEntropyLoss(), nn.MSELoss(), nn.BCEWithLogitsLoss()):
        assert isinstance(loss_rule_for(loss), LossRule)


def test_cross_entropy_samples_classes_with_the_predicted_frequencies():
    """Inverse-CDF sampling: frequencies within 5 standard errors, zero-probability classes
    never drawn, every index in range."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.0, 0.2, 0.8, 0.0], [0.5, 0.0, 0.25, 0.25]], dtype=torch.float64)
    draws = 200_000
    sampled = _sample_classes(probs, draws)
    assert sampled.shape == (2, draws) and int(sampled.min()) >= 0 and int(sampled.max()) <= 3
    for row, p in zip(sampled, probs):
        freq = torch.bincount(row, minlength=4).double() / draws
        stderr = (p * (1 - p) / draws).sqrt()
        assert bool(((freq - p).abs() <= 5 * stderr + 1e-12).all()), (freq, p)
        assert bool((freq[p == 0] == 0).all())


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_cross_entropy_sampler_stays_in_range_for_rows_not_summing_to_one(dtype):
    """A softmax row sums to ``1 ± eps``; rows summing to 0.9999 make ``u > cdf[-1]`` about
    once in 10^4 draws (20 expected here), which must neither leave ``[0, C)`` nor land on a
    class of probability 0; frequencies follow the normalised row."""
    torch.manual_seed(0)
    probs = torch.tensor([[0.2, 0.3, 0.4999, 0.0], [0.25, 0.25, 0.25, 0.2499]], dtype=dtype)
    draws = 200_000
    sampled = _sample_classes(probs, draws)
    assert int(sampled.min()) >= 0 and int(sampled.max()) <= 3
    assert not bool((sampled[0] == 3).any())
    for row, p in zip(sampled, probs.double()):
        p = p / p.sum()
        freq = torch.bincount(row, minlength=4).double() / draws
        assert bool(((freq - p).abs() <= 5 * (p * (1 - p) / draws).sqrt() + 1e-12).all())


# ----------------------------------------------------------------------------- divisor read once


@pytest.mark.parametrize(("make", "args"), CASES)
def test_divisor_handed_in_gives_the_same_numbers(make, args):
    """A pass reads the loss's divisor once and hands it to ``reduction_scale`` and the
    factors: the numbers are those each computes on its own, bit for bit."""
    loss, output, target = make(*args)
    rule = loss_rule_for(loss)
    divisor = rule.divisor(loss, output, target)
    assert rule.check(loss, output, target) == divisor
    assert rule.reduction_scale(loss, output, target, divisor=divisor) == rule.reduction_scale(
        loss, output, target
    )
    own = rule.sqrt_hessian(loss, output, target)
    handed = rule.sqrt_hessian(loss, output, target, check=False, divisor=divisor)
    assert torch.equal(handed, own)
    draws = []
    for given_divisor in (None, divisor):
        torch.manual_seed(3)
        draws.append(rule.sqrt_hessian_mc(loss, output, target, 2, divisor=given_divisor))
    assert torch.equal(*draws)


@pytest.mark.parametrize("option", ["plain", "weight+ignore+smooth", "soft+weight"])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_cross_entropy_with_one_trailing_position_matches_hessian(option, reduction):
    """Logits ``[N, C, 1]``: the one-position factor, against ``torch.func.hessian``."""
    loss, output, target = ce_case(3, (1,), option, reduction, seed=1)
    rule = loss_rule_for(loss)
    factor = rule.sqrt_hessian(loss, output, target)
    assert factor.shape == (C, *output.shape)
    torch.testing.assert_close(gram(factor), reference_blocks(loss, output, target))
    assert torch.equal(factor[..., 0], rule.sqrt_hessian(loss, output[..., 0], target[..., 0]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("size", [3, 40, 5000])
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_finite_check_rejects_every_non_finite_input(dtype, size, bad):
    """The loss input's finite check (``max |x|`` finite) rejects a nan or an infinity at
    any position, as ``isfinite(x).all()`` does, and passes finite inputs."""
    rule = loss_rule_for(nn.MSELoss())
    gen = torch.Generator().manual_seed(size)
    output = torch.randn(2, size, generator=gen).to(dtype)
    rule.check(nn.MSELoss(), output, output)
    for position in (0, size // 2, 2 * size - 1):
        broken = output.clone()
        broken.view(-1)[position] = bad
        assert not torch.isfinite(broken).all()
        with pytest.raises(ValueError, match="inf or nan"):
            rule.check(nn.MSELoss(), broken, output)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "tail"), [(5, ()), (3, (4,)), (300, ())])
def test_cross_entropy_mean_over_every_position_skips_the_target(dtype, n, tail):
    """Without class weights or smoothing, "mean" over every position has ``beta = 1 / P``:
    the factors made from the divisor alone equal those made from the target's row weights,
    bit for bit; the divisor the check proves is the one ``divisor`` reads (300 positions:
    more than bfloat16 counts exactly, where the check leaves the count to ``divisor``)."""
    gen = torch.Generator().manual_seed(n)
    loss = nn.CrossEntropyLoss()
    output = (2 * torch.randn(n, C, *tail, generator=gen)).to(dtype)
    target = torch.randint(0, C, (n, *tail), generator=gen)
    rule = loss_rule_for(loss)
    divisor = rule.check(loss, output, target)
    assert divisor == rule.divisor(loss, output, target)
    from_target = rule.sqrt_hessian(loss, output, target, check=False)  # divisor unknown
    assert torch.equal(rule.sqrt_hessian(loss, output, target, divisor=divisor), from_target)
    draws = []
    for given_divisor in (None, divisor):
        torch.manual_seed(0)
        draws.append(
            rule.sqrt_hessian_mc(loss, output, target, 3, check=False, divisor=given_divisor)
        )
    assert torch.equal(*draws)
