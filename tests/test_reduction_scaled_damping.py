"""The damping that follows the loss's reduction (``KFAC``'s and ``EKFAC``'s default):
``λ = α s``, ``s = Σ w N / D`` over the losses and micro-batches of a step, and the trust
region's bound ``κ s``.

``s`` against the loss's own definition: ``D = L_sum / L`` (the loss with ``reduction="sum"``
over the loss as given), so ``s = w N L / L_sum`` for each loss entering the backward with the
factor ``w``. The steps in float64: the default equals a twin with the absolute ``λ = α s`` and
``kl_clip = κ s``; a mean, a sum and a per-sample mean of the same per-pixel loss take the same
steps (refreshes and plain steps, the trust region active), which an absolute damping does not.
"""

import pytest
import torch
from torch import nn

import curvopt
from curvopt import extensions
from curvopt.optim import EKFAC, KFAC, ReductionScaledDamping
from curvopt.optim.options import DEFAULT_REDUCTION_DAMPING

DT = torch.float64


def _mlp(outputs=3, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, outputs))
    return curvopt.extend(model.to(DT))


def _classes(n=12, seed=1, classes=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def _pixels(n=12, seed=1, pixels=4):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=g, dtype=DT), torch.randn(n, pixels, generator=g, dtype=DT)


def _expected(loss_cls, output, target, weight=1.0, **options):
    """``w N L / L_sum``: the reduction's scale from the loss's definition."""
    loss = loss_cls(**options)(output, target)
    total = loss_cls(**{**options, "reduction": "sum"})(output, target)
    return weight * output.shape[0] * float(loss / total)


@pytest.mark.parametrize(
    "loss_cls, options, data, weight",
    [
        (nn.CrossEntropyLoss, {"reduction": "mean"}, _classes, 1.0),
        (nn.CrossEntropyLoss, {"reduction": "sum"}, _classes, 1.0),
        (nn.CrossEntropyLoss, {"reduction": "mean", "ignore_index": 2}, _classes, 1.0),
        (nn.MSELoss, {"reduction": "mean"}, _pixels, 1.0),
        (nn.MSELoss, {"reduction": "sum"}, _pixels, 0.25),
        (nn.BCEWithLogitsLoss, {"reduction": "mean"}, _pixels, 3.0),
    ],
)
def test_the_reduction_scale_is_the_losss_samples_over_its_divisor(loss_cls, options, data, weight):
    """A mean over samples 1, a sum ``N``, a per-pixel mean ``1/P``, times the factor the
    loss enters the backward with; ``ignore_index``: ``N`` over the rows it keeps."""
    outputs = 4 if data is _pixels else 3
    model = _mlp(outputs)
    X, y = data()
    if loss_cls is nn.BCEWithLogitsLoss:
        y = (y > 0).to(DT)
    with curvopt.collect(extensions.KFLR()) as block:
        (weight * curvopt.extend(loss_cls(**options))(model(X), y)).backward()
    with torch.no_grad():
        expected = _expected(loss_cls, model(X), y, weight, **options)
    assert block.reduction_scale == pytest.approx(expected, rel=1e-12)
    reference = {"mean": 1.0, "sum": float(len(X))}[options["reduction"]] * weight
    if loss_cls is not nn.CrossEntropyLoss:
        reference /= 1 if options["reduction"] == "sum" else outputs  # a mean over pixels
    elif "ignore_index" in options:
        reference = len(X) / float((y != 2).sum())
    assert block.reduction_scale == pytest.approx(reference, rel=1e-12)


def test_flattened_tokens_of_a_sequence_count_one_each():
    """A language model's cross-entropy over ``[N·T, V]`` rows averages over its tokens: 1."""
    model = _mlp()
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(4, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (4, 5), generator=g)
    with curvopt.collect(extensions.KFLR()) as block:
        lossfunc = curvopt.extend(nn.CrossEntropyLoss())
        lossfunc(model(X).reshape(-1, 3), y.reshape(-1)).backward()
    assert block.reduction_scale == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("ignore_index", [-100, 2])
def test_a_sequences_logits_count_their_positions_as_flattened_tokens_do(ignore_index):
    """``[N, C, T]`` logits (``nn.CrossEntropyLoss``'s own sequence layout) give the ``s`` of
    the same logits flattened to ``[N·T, C]``: one term per position, also where
    ``ignore_index`` drops some, so that the default damping does not depend on the layout."""
    model = _mlp()
    g = torch.Generator().manual_seed(4)
    X, y = torch.randn(4, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (4, 5), generator=g)
    scales = []
    for layout in ("sequence", "flat"):
        lossfunc = curvopt.extend(nn.CrossEntropyLoss(ignore_index=ignore_index))
        with curvopt.collect(extensions.KFLR()) as block:
            logits = model(X)  # [N, T, C]
            if layout == "sequence":
                lossfunc(logits.transpose(1, 2), y).backward()
            else:
                lossfunc(logits.reshape(-1, 3), y.reshape(-1)).backward()
        scales.append(block.reduction_scale)
    kept = float((y != ignore_index).sum())
    assert scales[0] == pytest.approx(y.numel() / kept, rel=1e-12)
    assert scales[1] == pytest.approx(scales[0], rel=1e-12)


def test_several_losses_and_micro_batches_add_as_their_curvatures():
    """Two losses in one pass: ``Σ_l w_l N_l / D_l``; two micro-batches: their sum (two of
    ``loss / 2`` make one batch's ``1``)."""
    model = _mlp()
    X, y = _classes()
    mean = curvopt.extend(nn.CrossEntropyLoss())
    summed = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    with curvopt.collect(extensions.KFLR()) as block:
        (mean(model(X), y) + 0.5 * summed(model(X[:5]), y[:5])).backward()
    assert block.reduction_scale == pytest.approx(1.0 + 0.5 * 5, rel=1e-12)
    with curvopt.collect(extensions.KFLR()) as block:
        for half in (slice(0, 6), slice(6, 12)):
            (mean(model(X[half]), y[half]) / 2).backward()
    assert block.reduction_scale == pytest.approx(1.0, rel=1e-12)


def _run(make, reduction, steps=5, weight=lambda n: 1.0, sizes=(8, 12)):
    """Parameter changes of ``steps`` steps of a per-pixel ``MSELoss`` (4 pixels) with
    ``reduction``, times ``weight(N)``, on batches of ``sizes`` samples in turn; and the
    optimizer's ``s`` after each step."""
    model = _mlp(4)
    opt = make(model.parameters())
    lossfunc = curvopt.extend(nn.MSELoss(reduction=reduction))
    changes, scales = [], []
    for step in range(steps):
        n = sizes[step % len(sizes)]
        X, y = _pixels(n=n, seed=10 + step)
        opt.zero_grad()
        (weight(n) * lossfunc(model(X), y)).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        change = [(b - p.detach()).flatten() for b, p in zip(before, model.parameters())]
        changes.append(torch.cat(change))
        scales.append(opt._group_state[0].get("reduction_scale"))
    return changes, scales


@pytest.mark.parametrize("cls", [KFAC, EKFAC])
def test_the_default_is_the_absolute_damping_alpha_s_with_the_trust_region_kappa_s(cls):
    """A sum over 12 samples: ``λ = α N`` and ``κ = 1e-3 N``, the steps of a twin given them
    (refreshes and plain steps, the trust region acting)."""
    lr, n = 0.5, 12
    default, scales = _run(
        lambda ps: cls(ps, lr, curvature="kflr", curvature_interval=2), "sum", sizes=(n,)
    )
    assert scales == [n] * 5
    twin, _ = _run(
        lambda ps: cls(
            ps,
            lr,
            DEFAULT_REDUCTION_DAMPING * n,
            curvature="kflr",
            curvature_interval=2,
            kl_clip=1e-3 * n,
            # EKFAC's default trust region measures steps in the factors' eigenvalues, and its
            # bases are refreshed warm, at every third curvature step
            **(
                {"trust_metric": "ggn", "basis_refresh": "warm", "basis_interval": 6}
                if cls is EKFAC
                else {}
            ),
        ),
        "sum",
        sizes=(n,),
    )
    for a, b in zip(default, twin):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)


def test_s_is_read_at_every_refresh():
    """A sum over 8, 12, 16 samples in turn, the curvature every 2 steps: ``s`` is the ``N``
    of the last refresh (steps 0, 2, 4: 8, 16, 12)."""
    _, scales = _run(
        lambda ps: KFAC(ps, 0.1, curvature="kflr", curvature_interval=2),
        "sum",
        sizes=(8, 12, 16),
    )
    assert scales == [8, 8, 16, 16, 12]


@pytest.mark.parametrize("cls", [KFAC, EKFAC])
def test_the_steps_are_the_same_whatever_the_reduction(cls):
    """A per-pixel mean, a sum, and the sum over a sample's pixels averaged over the samples
    (``sum / N``: ``w = 1/N``) of the same data, on batches of 8 and 12: the same steps in
    float64 at the defaults (``kl_clip`` clips them: without it they are longer), not with an
    absolute damping."""

    def default(ps):
        return cls(ps, 0.5, curvature="kflr", curvature_interval=2)

    mean, scales = _run(default, "mean")
    assert scales == [0.25] * 5  # 1/4 pixels
    for other, weight in (("sum", lambda n: 1.0), ("sum", lambda n: 1 / n)):
        for a, b in zip(mean, _run(default, other, weight=weight)[0]):
            torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-14)
    unclipped = _run(
        lambda ps: cls(ps, 0.5, curvature="kflr", curvature_interval=2, kl_clip=None), "mean"
    )[0]
    assert unclipped[0].norm() > 1.5 * mean[0].norm()  # the trust region acted

    def absolute(ps):
        return cls(ps, 0.5, 1e-2, curvature="kflr", curvature_interval=2)

    first = _run(absolute, "mean", steps=1)[0][0], _run(absolute, "sum", steps=1)[0][0]
    assert not torch.allclose(*first, rtol=1e-3)


def test_a_strategy_given_sets_alpha_and_the_default_reports_it():
    model = _mlp()
    opt = KFAC(model.parameters(), lr=0.1)
    assert opt.defaults["damping"] is None and opt.defaults["relative_damping"] is None
    assert opt.damping() == DEFAULT_REDUCTION_DAMPING
    runs = []
    options = {"curvature": "kflr", "curvature_interval": 1, "kl_clip": None}
    for damping in (ReductionScaledDamping(0.05), 0.05 * 0.25):  # s = 1/4 pixels
        changes, _ = _run(lambda ps, d=damping: KFAC(ps, 0.5, d, **options), "mean")
        runs.append(changes)
    for a, b in zip(*runs):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-15)
    assert KFAC(model.parameters(), 0.1, ReductionScaledDamping(0.05)).damping() == 0.05
    with pytest.raises(ValueError, match="ReductionScaledDamping fraction"):
        ReductionScaledDamping(-1.0)


def _sum_step(make, passes, closure=False):
    """One step of ``make``'s optimizer on a ``MSELoss(reduction="sum")`` over 12 samples, in
    ``passes`` micro-batches (or by a closure); the parameter change and ``s``."""
    model = _mlp(4)
    opt = make(model.parameters())
    lossfunc = curvopt.extend(nn.MSELoss(reduction="sum"))
    X, y = _pixels(n=12, seed=5)
    before = [p.detach().clone() for p in model.parameters()]

    def backward():
        opt.zero_grad()
        for part in torch.arange(12).chunk(passes):
            lossfunc(model(X[part]), y[part]).backward()
        return torch.zeros(())

    if closure:
        opt.step(backward)
    elif opt._collection_mode == "explicit":
        with opt.collect():
            backward()
        opt.step()
    else:
        backward()
        opt.step()
    change = torch.cat([(b - p.detach()).flatten() for b, p in zip(before, model.parameters())])
    return change, opt._group_state[0]["reduction_scale"]


def test_micro_batches_explicit_blocks_and_closures_hand_over_s():
    """Two micro-batches of a sum over 6 samples each: ``s = 12`` and the step of one batch of
    12 (``KFAC(kflr)``), whether the optimizer's armed collection, its ``opt.collect()`` block
    (``collection="explicit"``) or a closure collects them."""
    one, scale = _sum_step(lambda ps: KFAC(ps, 0.5, curvature="kflr"), passes=1)
    assert scale == 12.0
    for options, closure in (({}, False), ({"collection": "explicit"}, False), ({}, True)):
        two, scale = _sum_step(
            lambda ps, o=options: KFAC(ps, 0.5, curvature="kflr", **o), passes=2, closure=closure
        )
        assert scale == 12.0
        torch.testing.assert_close(two, one, rtol=1e-10, atol=1e-14)


def test_passes_in_a_block_of_your_own_keep_the_last_s():
    """The optimizer's collection stands aside for a ``curvopt.collect`` block that computes its
    quantities: it sees no ``s`` and keeps the last one, 1 before any (the documented fallback):
    the step of the absolute ``λ = 1e-2`` and ``κ = 1e-3``, whatever the sum's ``N = 12``."""
    changes = []
    for damping in (None, DEFAULT_REDUCTION_DAMPING):
        model = _mlp(4)
        opt = KFAC(model.parameters(), 0.5, damping, curvature="kflr")
        lossfunc = curvopt.extend(nn.MSELoss(reduction="sum"))
        X, y = _pixels(n=12, seed=5)
        with curvopt.collect(extensions.KFLR()) as block:
            lossfunc(model(X), y).backward()
        before = [p.detach().clone() for p in model.parameters()]
        opt.step()
        changes.append(torch.cat([(b - p).flatten() for b, p in zip(before, model.parameters())]))
        assert block.reduction_scale == 12.0 and "reduction_scale" not in opt._group_state[0]
    torch.testing.assert_close(changes[0], changes[1], rtol=1e-12, atol=1e-15)
