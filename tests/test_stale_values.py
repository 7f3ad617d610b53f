"""Never a stale value (API.md; docs/conventions.md, "Parameters a pass does not reach").

A parameter of an extended model that requires grad but that a backward pass does not reach
(an unused head, a skipped branch, an expert without tokens, a module not called) holds no
value of an earlier pass afterwards: its per-sample gradients are zero, so every quantity built
from them or from its (zero) curvature block is zero, of the pass's ``N`` rows; Kronecker
factors and eigenbases are not defined there and are absent. Every value is checked in float64
against per-sample loops and ``torch.func`` on a plain copy of the model.
"""

import copy

import pytest
import torch
from conftest import (
    DT,
    FIRST_ORDER,
    assert_close,
    ggn_reference,
    hessian_reference,
    per_sample_grads_loop,
    reduce_reference,
)
from torch import nn

import curvopt
from curvopt import extensions as ext

N1, N2 = 5, 3

#: zero where the parameter is not reached (per-sample: ``[N, ...]``; summed: ``p.shape``)
DIAGONALS = {
    "diag_ggn_exact": ext.DiagGGNExact,
    "diag_ggn_exact_batch": ext.BatchDiagGGNExact,
    "diag_ggn_mc": ext.DiagGGNMC,
    "diag_ggn_mc_batch": ext.BatchDiagGGNMC,
    "diag_h": ext.DiagHessian,
    "diag_h_batch": ext.BatchDiagHessian,
}
#: absent where the parameter is not reached (not defined without its inputs)
FACTORED = {"kflr": ext.KFLR, "kfac": ext.KFAC, "kfra": ext.KFRA, "ekfac": ext.EKFAC}


class TwoHeads(nn.Module):
    """A multi-task model: a shared body and one head per task, one head used per batch."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.heads = nn.ModuleList([nn.Linear(4, 2), nn.Linear(4, 2)])

    def forward(self, x, task):
        return self.heads[task](torch.tanh(self.body(x)))


class Branch(nn.Module):
    """A residual branch taken only where the batch's first input is positive (data-dependent),
    a module called whose output the loss does not use, and a module never called."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.branch = nn.Linear(4, 4)
        self.aside = nn.Linear(4, 3)
        self.spare = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        h = torch.tanh(self.body(x))
        if x[0, 0] > 0:
            h = h + torch.tanh(self.branch(h))
        self.aside(h)  # computed, not used by the loss
        return self.head(h)


class Experts(nn.Module):
    """MoE-like: each sample goes to one expert chosen from its inputs; an expert without
    samples is not called (dense dispatch: a called expert sees the batch, masked)."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(3, 4)
        self.experts = nn.ModuleList([nn.Linear(4, 2) for _ in range(3)])

    def forward(self, x):
        h = torch.tanh(self.body(x))
        route = (x[:, 0] > 0).long() + (x[:, 1] > 0).long()
        out = h.new_zeros(x.shape[0], 2)
        for e, expert in enumerate(self.experts):
            mask = route == e
            if mask.any():
                out = out + mask.unsqueeze(1).to(h.dtype) * expert(h)
        return out


def _batch(n, sign=None):
    x = torch.randn(n, 3, dtype=DT)
    if sign is not None:  # every sample alike, so that a loop over samples takes the same path
        x[:, 0] = sign * x[:, 0].abs()
    return x, torch.randint(0, 2, (n,))


def _collect(model, lossfunc, inputs, y, extensions):
    """A fresh gradient, then one backward pass inside ``collect(*extensions)``."""
    model.zero_grad()
    with curvopt.collect(*extensions):
        lossfunc(model(*inputs), y).backward()


def _first_order_reference(plain, reduction, inputs, y):
    return per_sample_grads_loop(plain, nn.CrossEntropyLoss(reduction=reduction), inputs, y)


def _check_first_order(model, reference, what=""):
    for name, p in model.named_parameters():
        expected = reduce_reference(reference[name])
        for attr in FIRST_ORDER:
            assert_close(getattr(p, attr, None), expected[attr], f"{what}{name}.{attr}")


# ------------------------------------------------------------------------------ two heads


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_readme_norms_recipe_after_the_other_head(reduction, seed):
    """The README's per-sample norms after a batch of the other task are the true ones (the
    unused head's old ``batch_l2`` made them 38% too large)."""
    plain = TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    batches = [(0, *_batch(N1)), (1, *_batch(N2))]
    for task, x, y in batches:
        _collect(model, lossfunc, (x, task), y, [ext.BatchL2Grad()])
    norms = sum(p.batch_l2 for p in model.parameters()).sqrt()
    task, x, y = batches[-1]
    reference = _first_order_reference(plain, reduction, (x, task), y)
    expected = sum(g.flatten(1).pow(2).sum(1) for g in reference.values()).sqrt()
    assert_close(norms, expected, "norms")


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_first_order_of_the_unused_head_is_zero(reduction, seed):
    plain = TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    extensions = [cls() for cls in FIRST_ORDER.values()]
    for task, n in ((0, N1), (1, N2)):
        x, y = _batch(n)
        _collect(model, lossfunc, (x, task), y, extensions)
        reference = _first_order_reference(plain, reduction, (x, task), y)
        _check_first_order(model, reference, f"task {task}: ")
    unused = model.heads[0]
    assert unused.weight.grad is None
    assert unused.weight.grad_batch.shape == (N2, *unused.weight.shape)
    assert unused.bias.batch_l2.shape == (N2,)


@pytest.mark.parametrize("attr", list(DIAGONALS))
def test_diagonals_of_the_unused_head_are_zero(attr, seed):
    plain = TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    for task, n in ((0, N1), (1, N2)):
        x, y = _batch(n)
        _collect(model, lossfunc, (x, task), y, [DIAGONALS[attr]()])
    if "ggn" in attr:
        blocks, per_sample = ggn_reference(plain, nn.CrossEntropyLoss(), (x, task), y)
        summed = {k: torch.diagonal(b).reshape(per_sample[k].shape[1:]) for k, b in blocks.items()}
    else:
        summed, per_sample = hessian_reference(plain, nn.CrossEntropyLoss(), (x, task), y)
    expected = per_sample if attr.endswith("_batch") else summed
    for name, p in model.named_parameters():
        if name.startswith("heads.0") or "_mc" not in attr:  # the MC draws: zero where unused
            assert_close(getattr(p, attr), expected[name], f"{name}.{attr}")
    assert expected["heads.0.weight"].abs().max() == 0  # the reference's value: zero


@pytest.mark.parametrize("attr", list(FACTORED))
def test_kronecker_factors_of_the_unused_head_are_absent(attr, seed):
    """Absent on the unused head; on the others, what a model's first pass writes."""
    plain = TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    fresh = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    (x1, y1), (x2, y2) = _batch(N1), _batch(N2)
    _collect(model, lossfunc, (x1, 0), y1, [FACTORED[attr]()])
    torch.manual_seed(1)
    _collect(model, lossfunc, (x2, 1), y2, [FACTORED[attr]()])
    torch.manual_seed(1)
    _collect(fresh, lossfunc, (x2, 1), y2, [FACTORED[attr]()])
    assert not hasattr(model.heads[0].weight, attr) and not hasattr(model.heads[0].bias, attr)
    for (name, p), q in zip(model.named_parameters(), fresh.parameters()):
        if not name.startswith("heads.0"):
            for mine, theirs in zip(getattr(p, attr), getattr(q, attr)):
                assert_close(mine, theirs, f"{name}.{attr}")


def test_kronecker_fallback_diagonal_of_a_parameter_not_reached_is_absent(seed):
    """``skip_unsupported="diagonal"``: the diagonal written instead of factors goes too."""

    class Scaled(TwoHeads):
        def __init__(self):
            super().__init__()
            self.gains = nn.ModuleList([_Gain(), _Gain()])

        def forward(self, x, task):
            return self.gains[task](super().forward(x, task))

    model = curvopt.extend(Scaled().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    for task in (0, 1):
        x, y = _batch(N1)
        model.zero_grad()
        with pytest.warns(UserWarning, match="no Kronecker factors"):
            with curvopt.collect(ext.KFLR(), skip_unsupported="diagonal"):
                lossfunc(model(x, task), y).backward()
        assert hasattr(model.gains[task].scale, "kflr_diagonal")
    assert not hasattr(model.gains[0].scale, "kflr_diagonal")
    assert not hasattr(model.gains[0].scale, "kflr")


class _Gain(nn.Module):
    """An element-wise gain held as a raw 3-D parameter: no Kronecker factorisation."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.rand(1, 2, 1, dtype=DT) + 0.5)

    def forward(self, x):
        return x * self.scale.view(2)


# ------------------------------------------------------------------------------ several passes


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_micro_batches_of_one_collect_combine_with_zeros(reduction, seed):
    """Head 0 in pass 1, head 1 in pass 2 of one ``collect``: per-sample quantities over all
    ``N1 + N2`` samples (zero rows where a head was not used), summed ones added, Kronecker
    factors each head's own pass's."""
    plain = TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    batches = [(0, *_batch(N1)), (1, *_batch(N2))]
    extensions = [cls() for cls in FIRST_ORDER.values()] + [ext.DiagGGNExact(), ext.KFLR()]
    with curvopt.collect(*extensions):
        for task, x, y in batches:
            lossfunc(model(x, task), y).backward()
    loss = nn.CrossEntropyLoss(reduction=reduction)
    references = [per_sample_grads_loop(plain, loss, (x, t), y) for t, x, y in batches]
    _check_first_order(model, {k: torch.cat([r[k] for r in references]) for k in references[0]})
    blocks = [ggn_reference(plain, loss, (x, t), y)[0] for t, x, y in batches]
    for name, p in model.named_parameters():
        expected = sum(torch.diagonal(b[name]) for b in blocks).reshape(p.shape)
        assert_close(p.diag_ggn_exact, expected, f"{name}.diag_ggn_exact")
    for task, x, y in batches:
        alone = curvopt.extend(copy.deepcopy(plain))
        _collect(alone, lossfunc, (x, task), y, [ext.KFLR()])
        for name in ("weight", "bias"):
            mine = getattr(model.heads[task], name).kflr
            for f, g in zip(mine, getattr(alone.heads[task], name).kflr):
                assert_close(f, g, f"heads.{task}.{name}.kflr")


def test_separate_collects_leave_no_value_of_the_first(seed):
    """The same two passes in two ``collect`` blocks: after the second, head 0 holds the
    second pass's zeros (``N2`` rows) and no Kronecker factors."""
    model = curvopt.extend(TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    extensions = [ext.BatchGrad(), ext.Variance(), ext.DiagGGNExact(), ext.KFLR()]
    for task, n in ((0, N1), (1, N2)):
        x, y = _batch(n)
        _collect(model, lossfunc, (x, task), y, extensions)
    head = model.heads[0].weight
    assert head.grad_batch.shape == (N2, *head.shape) and head.grad_batch.abs().max() == 0
    assert head.variance.abs().max() == 0 and head.diag_ggn_exact.abs().max() == 0
    assert not hasattr(head, "kflr")


def test_backward_with_inputs_leaves_no_earlier_value_on_the_parameters_left_out(seed):
    """A pass that leaves a parameter out on purpose (``backward(inputs=...)``) writes nothing
    for it, and takes off an earlier ``collect``'s value."""
    model = curvopt.extend(TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _batch(N1)
    _collect(model, lossfunc, (x, 0), y, [ext.BatchGrad(), ext.DiagGGNExact()])
    model.zero_grad()
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
        lossfunc(model(x, 0), y).backward(inputs=[model.body.weight])
    for name, p in model.named_parameters():
        if name.startswith("heads.1"):  # not reached at all: zero
            assert p.grad_batch.abs().max() == 0 and p.diag_ggn_exact.abs().max() == 0
        else:  # written, or left out on purpose
            written = name == "body.weight"
            assert ("grad_batch" in p.__dict__) == written, name
            assert ("diag_ggn_exact" in p.__dict__) == written, name


def test_a_model_the_pass_does_not_go_through_keeps_its_values(seed):
    """Only the models the pass goes through (what ``extend`` was called on) are concerned."""
    model, other = curvopt.extend(TwoHeads().to(DT)), curvopt.extend(TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _batch(N1)
    _collect(other, lossfunc, (x, 0), y, [ext.BatchGrad(), ext.KFLR()])
    kept = other.body.weight.grad_batch
    _collect(model, lossfunc, (x, 0), y, [ext.BatchGrad(), ext.KFLR()])
    assert other.body.weight.grad_batch is kept and hasattr(other.body.weight, "kflr")
    assert not hasattr(model.heads[1].weight, "kflr")


# ------------------------------------------------------------------------------ other shapes


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_skipped_branch_and_modules_not_called(reduction, seed):
    """Pass 1 takes the branch, pass 2 skips it: after pass 2 the branch, the module called
    aside and the module never called hold zeros, and no Kronecker factors."""
    plain = Branch().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    extensions = [cls() for cls in FIRST_ORDER.values()] + [ext.DiagGGNExact(), ext.KFLR()]
    for sign in (1.0, -1.0):
        x, y = _batch(N1, sign)
        _collect(model, lossfunc, (x,), y, extensions)
    loss = nn.CrossEntropyLoss(reduction=reduction)
    _check_first_order(model, per_sample_grads_loop(plain, loss, x, y))
    blocks, _ = ggn_reference(plain, loss, x, y)
    for name, p in model.named_parameters():
        expected = torch.diagonal(blocks[name]).reshape(p.shape)
        assert_close(p.diag_ggn_exact, expected, f"{name}.diag_ggn_exact")
        assert hasattr(p, "kflr") == name.startswith(("body", "head")), name
    assert model.branch.weight.grad is None and model.spare.weight.grad is None


def test_expert_without_samples(seed):
    """An expert no sample is routed to is not called: zeros, no Kronecker factors."""
    plain = Experts().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    extensions = [cls() for cls in FIRST_ORDER.values()] + [ext.DiagGGNExact(), ext.KFLR()]
    x, y = _batch(N1)
    x[:, 0], x[:, 1] = x[:, 0].abs(), x[:, 1].abs()  # every sample to expert 2
    _collect(model, lossfunc, (x,), y, extensions)
    x[:, 1] = -x[:, 1]  # now to expert 1: expert 2 has none
    _collect(model, lossfunc, (x,), y, extensions)
    _check_first_order(model, per_sample_grads_loop(plain, nn.CrossEntropyLoss(), x, y))
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), x, y)
    for name, p in model.named_parameters():
        expected = torch.diagonal(blocks[name]).reshape(p.shape)
        assert_close(p.diag_ggn_exact, expected, f"{name}.diag_ggn_exact")
        assert hasattr(p, "kflr") == name.startswith(("body", "experts.1")), name


# ------------------------------------------------------------------------------ optimizers

OPTIMIZERS = {
    "kfac": lambda params: curvopt.optim.KFAC(params, lr=0.1, damping=0.1, curvature="kflr"),
    "diag": lambda params: curvopt.optim.DiagGGNNewton(
        params, lr=0.1, damping=0.1, curvature="exact"
    ),
}


def _step(opt, model, lossfunc, x, y, task, set_to_none=True):
    opt.zero_grad(set_to_none=set_to_none)
    lossfunc(model(x, task), y).backward()
    opt.step()


@pytest.mark.parametrize("set_to_none", [True, False])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_optimizer_steps_alternating_heads(name, set_to_none, seed):
    """The armed collection, heads alternating over steps: the unused head holds no value of
    the previous window and does not move; the used head's step is a fresh optimizer's on the
    same model and batch (no earlier window's curvature in it)."""
    model = curvopt.extend(TwoHeads().to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = OPTIMIZERS[name](model.parameters())
    attr = "kflr" if name == "kfac" else "diag_ggn_exact"
    for step, task in enumerate((0, 1, 0, 1)):
        x, y = _batch(N1)
        twin = copy.deepcopy(model)  # a plain copy: extended below, with its own optimizer
        before = {k: p.detach().clone() for k, p in model.named_parameters()}
        _step(opt, model, lossfunc, x, y, task, set_to_none)
        unused = model.heads[1 - task]
        if attr == "kflr":
            assert not hasattr(unused.weight, attr)
        else:
            assert unused.weight.diag_ggn_exact.abs().max() == 0
        for k, p in model.named_parameters():
            if k.startswith(f"heads.{1 - task}"):
                assert torch.equal(p, before[k]), f"step {step}: {k} moved"
        twin = curvopt.extend(twin)
        fresh = OPTIMIZERS[name](twin.parameters())
        _step(fresh, twin, lossfunc, x, y, task)
        for (k, p), q in zip(model.named_parameters(), twin.parameters()):
            assert_close(p.detach(), q.detach(), f"step {step}: {k}")


@pytest.mark.parametrize("name", ["diag", "vsgd"])
def test_optimizer_window_of_micro_batches_reaching_different_heads(name, seed):
    """One window of the armed collection, head 0 in micro-batch 1 and head 1 in micro-batch 2:
    what the step reads is that of all ``N1 + N2`` samples (zero rows where a head was not
    used: VarianceAdaptedSGD's variance counts them), the summed curvature added."""
    plain = TwoHeads().to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    if name == "diag":
        opt = OPTIMIZERS["diag"](model.parameters())
    else:
        opt = curvopt.optim.VarianceAdaptedSGD(model.parameters(), lr=0.1)
    batches = [(0, *_batch(N1)), (1, *_batch(N2))]
    for step in range(2):  # the second window: no value of the first stays
        opt.zero_grad()
        for task, x, y in batches:
            lossfunc(model(x, task), y).backward()
        loss = nn.CrossEntropyLoss(reduction="sum")
        reference = copy.deepcopy(plain)  # the model as it is now, plain
        reference.load_state_dict(model.state_dict())
        if name == "diag":
            blocks = [ggn_reference(reference, loss, (x, t), y)[0] for t, x, y in batches]
            for k, p in model.named_parameters():
                expected = sum(torch.diagonal(b[k]) for b in blocks).reshape(p.shape)
                assert_close(p.diag_ggn_exact, expected, f"step {step}: {k}.diag_ggn_exact")
        else:
            grads = [per_sample_grads_loop(reference, loss, (x, t), y) for t, x, y in batches]
            for k, p in model.named_parameters():
                expected = reduce_reference(torch.cat([g[k] for g in grads]))["variance"]
                assert_close(p.variance, expected, f"step {step}: {k}.variance")
        opt.step()
