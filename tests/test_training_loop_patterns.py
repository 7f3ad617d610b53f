"""Training-loop machinery (issue 18): right numbers in float64 against torch.func / loop
references, or a specific error with nothing written.

Adversarial input gradients inside ``collect``, a penalty warmed up after the first pass, fresh
models in a sweep, mixup, sparse embeddings, in-place ops on a Linear output, a second loss
switched on later, checkpointing (reentrant or not), a model that was not extended.
"""

import copy
import weakref

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    ALL_ATTRS,
    DT,
    assert_close,
    assert_no_attributes,
    clear_attributes,
    collect_if_alive,
    ggn_reference,
    hessian_reference,
    per_sample_grads_loop,
    trainable,
)
from torch import nn
from torch.func import functional_call, hessian, jacrev
from torch.utils.checkpoint import checkpoint

import curvopt
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError
from curvopt.core.records import token

N = 6
CE = nn.CrossEntropyLoss()


def _mlp(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)


def _data(n=N):
    return torch.randn(n, 4, dtype=DT), torch.randint(0, 3, (n,))


def _extended(plain):
    return curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss())


def _diag(blocks, p, name):
    return torch.diagonal(blocks[name]).reshape(p.shape)


# ------------------------------------------------------------------ item 2: autograd.grad passes
def test_input_gradient_pass_writes_nothing():
    """FGSM: the attack's ``torch.autograd.grad`` inside collect contributes nothing; the
    training backward on the adversarial batch gets exactly its own quantities."""
    plain = _mlp()
    model, lossfunc = _extended(plain)
    x, y = _data()
    x.requires_grad_(True)
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact(), ext.Variance()):
        (gx,) = torch.autograd.grad(lossfunc(model(x), y), x)
        x_adv = (x + 0.1 * gx.sign()).detach()
        lossfunc(model(x_adv), y).backward()
    (want_gx,) = torch.autograd.grad(CE(plain(x), y), x)
    assert_close(gx, want_gx, "input gradient")
    grads = per_sample_grads_loop(plain, CE, x_adv, y)
    blocks, _ = ggn_reference(plain, CE, x_adv, y)
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, grads[name], name)
        assert_close(p.grad_batch.sum(0), p.grad, name)
        assert_close(p.variance, grads[name].var(0, unbiased=False), name)
        assert_close(p.diag_ggn_exact, _diag(blocks, p, name), name)


def test_input_gradient_pass_keeps_the_graph_for_the_training_backward():
    """``autograd.grad(..., retain_graph=True)`` then ``backward()`` through the same graph."""
    plain = _mlp()
    model, lossfunc = _extended(plain)
    x, y = _data()
    x.requires_grad_(True)
    loss = lossfunc(model(x), y)
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
        torch.autograd.grad(loss, x, retain_graph=True)
        assert_no_attributes(model)
        loss.backward()
    grads = per_sample_grads_loop(plain, CE, x.detach(), y)
    blocks, _ = ggn_reference(plain, CE, x.detach(), y)
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, grads[name], name)
        assert_close(p.diag_ggn_exact, _diag(blocks, p, name), name)


def test_parameter_gradient_by_autograd_grad_writes_nothing():
    model, lossfunc = _extended(_mlp())
    x, y = _data()
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
        torch.autograd.grad(lossfunc(model(x), y), list(model.parameters()))
    assert_no_attributes(model)


def test_backward_with_inputs_writes_only_those_parameters():
    plain = _mlp()
    model, lossfunc = _extended(plain)
    x, y = _data()
    first = model[0].weight
    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact()):
        lossfunc(model(x), y).backward(inputs=[first])
    grads = per_sample_grads_loop(plain, CE, x, y)
    blocks, _ = ggn_reference(plain, CE, x, y)
    assert_close(first.grad_batch, grads["0.weight"], "0.weight")
    assert_close(first.diag_ggn_exact, _diag(blocks, first, "0.weight"), "0.weight")
    for name, p in model.named_parameters():
        if p is not first:
            assert p.grad is None
            assert "grad_batch" not in p.__dict__ and "diag_ggn_exact" not in p.__dict__, name


@pytest.mark.parametrize("optimizer", ["DiagGGNNewton", "VarianceAdaptedSGD"])
def test_adversarial_closure_steps_like_the_training_pass_alone(optimizer):
    """``opt.step(closure)`` whose closure runs the attack first: the same update as a closure
    that only backpropagates the adversarial batch."""
    x, y = _data()
    gx = torch.autograd.grad(CE(_mlp()(x.requires_grad_(True)), y), x)[0]
    x_adv = (x + 0.1 * gx.sign()).detach()
    moved = []
    for attack in (True, False):
        model, lossfunc = _extended(_mlp())
        if optimizer == "DiagGGNNewton":
            opt = curvopt.optim.DiagGGNNewton(
                model.parameters(), lr=0.1, damping=1e-2, curvature="exact"
            )
        else:
            opt = curvopt.optim.VarianceAdaptedSGD(model.parameters(), lr=0.1)

        def closure(model=model, lossfunc=lossfunc, attack=attack, opt=opt):
            opt.zero_grad()
            if attack:  # recompute the attack inside the closure
                xr = x.detach().requires_grad_(True)
                torch.autograd.grad(lossfunc(model(xr), y), xr)
            loss = lossfunc(model(x_adv), y)
            loss.backward()
            return loss

        opt.step(closure)
        moved.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert_close(moved[0], moved[1], "parameters after one step")


# --------------------------------------------------- items 3, 4: checks on every pass, fresh keys
class _TwoOut(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return h, self.b(h)


@pytest.mark.parametrize("extension", [ext.DiagGGNExact, ext.DiagHessian, ext.KFLR, ext.DiagGGNMC])
@pytest.mark.parametrize("where", ["activations", "parameters"])
def test_penalty_warmed_up_later_raises(extension, where):
    """A z-loss / penalty outside the extended loss with weight 0 on the first passes and
    non-zero later: the later pass raises (the checks are not cached away)."""
    plain = _mlp()
    model, lossfunc = _extended(plain)
    x, y = _data()
    for lam in (0.0, 0.0, 0.3):
        clear_attributes(model, ALL_ATTRS)
        out = model(x)
        penalty = (out**2).sum() if where == "activations" else (model[2].weight ** 2).sum()
        loss = lossfunc(out, y) + lam * penalty
        if lam == 0.0:
            with curvopt.collect(extension()):
                loss.backward()
            assert extension().attr in model[0].weight.__dict__
            continue
        with pytest.raises(UnsupportedModuleError, match="alone|outside the module"):
            with curvopt.collect(extension()):
                loss.backward()
        assert_no_attributes(model)


def test_penalty_weight_zero_gives_the_reference_then_raises_diag_hessian():
    plain = _mlp()
    model, lossfunc = _extended(plain)
    x, y = _data()
    out = model(x)
    with curvopt.collect(ext.DiagHessian()):
        (lossfunc(out, y) + 0.0 * (out**2).sum()).backward()
    diag, _ = hessian_reference(plain, CE, x, y)
    for name, p in model.named_parameters():
        assert_close(p.diag_h, diag[name], name)


def test_fresh_modules_never_share_a_cache_token():
    """``id`` is reused once a module is freed (fresh models in a sweep); the token is not."""
    seen = {}
    for _ in range(200):
        module = nn.Linear(2, 2)
        if id(module) in seen:
            assert token(module) != seen[id(module)]
            return
        seen[id(module)] = token(module)
        freed = weakref.ref(module)
        del module
        collect_if_alive(freed)
    pytest.fail("no id was reused in 200 fresh modules: the test cannot exercise the reuse")


def test_sweep_of_fresh_models_checks_every_model():
    x, y = _data()
    for i in range(12):
        model, lossfunc = _extended(_mlp(seed=i))
        out = model(x)
        lam = 0.0 if i % 2 == 0 else 0.5
        loss = lossfunc(out, y) + lam * (out**2).sum()
        if lam == 0.0:
            with curvopt.collect(ext.DiagGGNExact()):
                loss.backward()
        else:
            with pytest.raises(UnsupportedModuleError, match="alone"):
                with curvopt.collect(ext.DiagGGNExact()):
                    loss.backward()
            assert_no_attributes(model)
        freed = weakref.ref(model)
        del model, lossfunc, out, loss
        collect_if_alive(freed)


# ------------------------------------------------------------------ item 5: mixup inside the model
class _Mixup(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.kind = kind

    def forward(self, x):
        h = torch.tanh(self.a(x))
        perm = torch.arange(1, x.shape[0] + 1) % x.shape[0]
        other = h[perm] if self.kind == "index" else torch.roll(h, 1, 0)
        return self.b(0.7 * h + 0.3 * other)


@pytest.mark.parametrize("kind", ["index", "roll"])
@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.Variance, ext.DiagGGNExact])
def test_manifold_mixup_raises(kind, extension):
    model = curvopt.extend(_Mixup(kind).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    for _ in range(2):  # every pass, not only the first of a graph structure
        with pytest.raises(UnsupportedModuleError, match="which of the 6 samples"):
            with curvopt.collect(extension()):
                lossfunc(model(x), y).backward()
        assert_no_attributes(model)


class _FeatureIndex(nn.Module):
    """Indexes by data inside the model without mixing samples (a feature permutation)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.a(x))
        return self.b(h[:, torch.tensor([4, 0, 3, 1, 2])])


def test_data_indexing_that_keeps_samples_apart_is_right():
    torch.manual_seed(0)
    plain = _FeatureIndex().to(DT)
    model, lossfunc = _extended(plain)
    x, y = _data()
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(x), y).backward()
    grads = per_sample_grads_loop(plain, CE, x, y)
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, grads[name], name)


# ------------------------------------------------------------------ item 6: sparse gradients
class _SparseEmbedding(nn.Module):
    def __init__(self, functional):
        super().__init__()
        self.emb, self.lin = nn.Embedding(7, 4, sparse=True), nn.Linear(4, 3)
        self.functional = functional

    def forward(self, idx):
        h = self.emb(idx)
        if self.functional:
            h = h + F.embedding(idx.flip(0), self.emb.weight, sparse=True)
        return self.lin(h)


@pytest.mark.parametrize("extension", [ext.BatchGrad, ext.SumGradSquared])
def test_sparse_embedding_also_used_functionally_raises(extension):
    torch.manual_seed(0)
    model = curvopt.extend(_SparseEmbedding(True).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    idx, y = torch.randint(0, 7, (N,)), torch.randint(0, 3, (N,))
    with pytest.raises(UnsupportedModuleError, match="emb.weight.*outside the module"):
        with curvopt.collect(extension()):
            lossfunc(model(idx), y).backward()
    assert_no_attributes(model)


def test_sparse_embedding_per_sample_gradients():
    torch.manual_seed(0)
    plain = _SparseEmbedding(False).to(DT)
    model, lossfunc = _extended(plain)
    idx, y = torch.randint(0, 7, (N,)), torch.randint(0, 3, (N,))
    with curvopt.collect(ext.BatchGrad()):
        lossfunc(model(idx), y).backward()
    dense = copy.deepcopy(plain)
    dense.emb.sparse = False
    grads = per_sample_grads_loop(dense, CE, idx, y)
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, grads[name], name)


# ------------------------------------------------------------------ in-place ops on [N, T, D]
class _InPlace(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.a, self.b = nn.Linear(4, 5), nn.Linear(5, 3)
        self.act = nn.ReLU(inplace=True)
        self.kind = kind

    def forward(self, x):
        h = self.a(x)
        if self.kind == "ReLU(inplace)":
            h = self.act(h)
        elif self.kind == "relu_":
            h.relu_()
        elif self.kind == "+=":
            h += x[..., :1] ** 2
        else:
            h *= 2
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("kind", ["ReLU(inplace)", "relu_", "+=", "*="])
def test_in_place_op_on_a_sequence_linear_output(kind):
    torch.manual_seed(0)
    plain = _InPlace(kind).to(DT)
    model, lossfunc = _extended(plain)
    x, y = torch.randn(N, 3, 4, dtype=DT), torch.randint(0, 3, (N, 3))

    def loss_on(out, target):
        return CE(out.reshape(-1, 3), target.reshape(-1))

    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        lossfunc(model(x).reshape(-1, 3), y.reshape(-1)).backward()
    grads = per_sample_grads_loop(plain, loss_on, x, y)
    blocks, per_sample = ggn_reference(plain, loss_on, x, y)
    for name, p in model.named_parameters():
        assert_close(p.grad_batch, grads[name], name)
        assert_close(p.diag_ggn_exact, _diag(blocks, p, name), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


# ------------------------------------------------------------------ a second loss switched on
def _two_loss_references(plain, x, y, aux_target, weight):
    """Diagonals of the GGN and the Hessian of ``CE(out, y) + weight * MSE(h, aux_target)``."""
    params = {k: p.detach() for k, p in trainable(plain).items()}
    mse = nn.MSELoss()

    def f(q):
        return functional_call(plain, q, (x,))

    h, out = f(params)
    jh, jo = jacrev(f)(params)
    hh = hessian(lambda o: weight * mse(o, aux_target))(h).reshape(h.numel(), h.numel())
    ho = hessian(lambda o: CE(o, y))(out).reshape(out.numel(), out.numel())
    ggn, diag_h = {}, {}
    for k, p in params.items():
        a, b = jh[k].reshape(h.numel(), -1), jo[k].reshape(out.numel(), -1)
        ggn[k] = torch.diagonal(a.T @ hh @ a + b.T @ ho @ b).reshape(p.shape)

        def total(q, k=k):
            hq, oq = f({**params, k: q})
            return CE(oq, y) + weight * mse(hq, aux_target)

        diag_h[k] = torch.diagonal(hessian(total)(p).reshape(p.numel(), p.numel())).reshape(p.shape)
    return ggn, diag_h


@pytest.mark.parametrize("fresh", [False, True])
def test_second_extended_loss_switched_on_later(fresh):
    """CE alone first, then CE + an extended auxiliary MSE on the hidden layer (also on a
    fresh model whose modules may reuse the ids of an earlier one)."""
    torch.manual_seed(0)
    plain = _TwoOut().to(DT)
    x, y = _data()
    aux_target = torch.randn(N, 5, dtype=DT)
    mse = curvopt.extend(nn.MSELoss())
    model, lossfunc = _extended(plain)
    exts = (ext.DiagGGNExact(), ext.DiagHessian(), ext.KFLR())
    for weight in (0.0, 0.5):
        if fresh and weight:
            freed = weakref.ref(model)
            del model
            collect_if_alive(freed)
            model = curvopt.extend(copy.deepcopy(plain))
        clear_attributes(model, ALL_ATTRS)
        h, out = model(x)
        loss = lossfunc(out, y)
        if weight:
            loss = loss + weight * mse(h, aux_target)
        with curvopt.collect(*exts):
            loss.backward()
        ggn, diag_h = _two_loss_references(plain, x, y, aux_target, weight)
        for name, p in model.named_parameters():
            assert_close(p.diag_ggn_exact, ggn[name], name)
            assert_close(p.diag_h, diag_h[name], name)
            assert len(p.kflr) == (2 if p.dim() == 2 else 1)


# ------------------------------------------------------------------ reentrant checkpointing
class _Checkpointed(nn.Module):
    def __init__(self, reentrant, tokens):
        super().__init__()
        self.emb = nn.Embedding(7, 4) if tokens else nn.Linear(4, 4)
        self.mid, self.head = nn.Linear(4, 5), nn.Linear(5, 7)
        self.reentrant = reentrant

    def block(self, h):
        return torch.tanh(self.mid(h))

    def forward(self, x):
        h = self.emb(x)
        if self.reentrant is None:  # the reference: no checkpoint (torch.func refuses them)
            return self.head(self.block(h))
        return self.head(checkpoint(self.block, h, use_reentrant=self.reentrant))


def _checkpoint_case(tokens):
    torch.manual_seed(0)
    if tokens:  # a sequence dimension, flattened rows
        x, y = torch.randint(0, 7, (N, 3)), torch.randint(0, 7, (N, 3))
    else:
        x, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 7, (N,))

    def loss_on(out, target):
        return CE(out.reshape(-1, 7), target.reshape(-1))

    return x, y, loss_on


def _unchecked(plain):
    reference = copy.deepcopy(plain)
    reference.reentrant = None
    return reference


@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_first_order(tokens, reentrant):
    x, y, loss_on = _checkpoint_case(tokens)
    plain = _Checkpointed(reentrant, tokens).to(DT)
    model, lossfunc = _extended(plain)
    for _ in range(2):
        clear_attributes(model, ALL_ATTRS)
        with curvopt.collect(ext.BatchGrad(), ext.BatchL2Grad()):
            lossfunc(model(x).reshape(-1, 7), y.reshape(-1)).backward()
        grads = per_sample_grads_loop(_unchecked(plain), loss_on, x, y)
        for name, p in model.named_parameters():
            assert_close(p.grad_batch, grads[name], name)
            assert_close(p.batch_l2, (grads[name] ** 2).flatten(1).sum(1), name)


@pytest.mark.parametrize("tokens", [False, True])
@pytest.mark.parametrize("reentrant", [True, False])
def test_checkpointing_second_order(tokens, reentrant):
    """Either kind of checkpoint: the reference (reentrant: curvopt re-runs the segment, see
    tests/test_reentrant_checkpoint.py)."""
    x, y, loss_on = _checkpoint_case(tokens)
    plain = _Checkpointed(reentrant, tokens).to(DT)
    model, lossfunc = _extended(plain)
    with curvopt.collect(ext.DiagGGNExact()):
        lossfunc(model(x).reshape(-1, 7), y.reshape(-1)).backward()
    blocks, _ = ggn_reference(_unchecked(plain), loss_on, x, y)
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, _diag(blocks, p, name), name)


# ------------------------------------------------------------------ a model that was not extended
@pytest.mark.parametrize(
    "extension", [ext.BatchGrad, ext.Variance, ext.DiagGGNExact, ext.KFAC, ext.DiagHessian]
)
def test_model_not_extended_raises_naming_the_fix(extension):
    model = _mlp()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data()
    with pytest.raises(UnsupportedModuleError, match=r"curvopt.extend\(model\)"):
        with curvopt.collect(extension()):
            lossfunc(model(x), y).backward()
    assert_no_attributes(model)


# ------------------------------------------------------------------ item 7: positionwise, [T, N]
class _Positionwise(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.lin, self.head = nn.Embedding(7, 4), nn.Linear(4, 4), nn.Linear(4, 7)

    def forward(self, idx):
        return self.head(torch.tanh(self.lin(self.emb(idx))))


@pytest.mark.parametrize("length", [5, N])
def test_sequence_first_positionwise_model_declared(length):
    """Embedding -> Linear -> head on ``[T, N]`` with flattened rows has nothing that tells
    ``T`` from ``N``; declared with ``extend(model, sequence_first=True)`` every per-sample
    quantity has ``N`` rows and equals the reference."""
    torch.manual_seed(0)
    plain = _Positionwise().to(DT)
    model = curvopt.extend(copy.deepcopy(plain), sequence_first=True)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    idx, y = torch.randint(0, 7, (length, N)), torch.randint(0, 7, (length, N))

    def loss_on(out, target):
        return CE(out.reshape(-1, 7), target.reshape(-1))

    with curvopt.collect(ext.BatchGrad(), ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        lossfunc(model(idx).reshape(-1, 7), y.reshape(-1)).backward()
    grads = per_sample_grads_loop(plain, loss_on, idx, y, in_dim=1, out_dim=1)
    blocks, per_sample = ggn_reference(plain, loss_on, idx, y, out_dim=1)
    for name, p in model.named_parameters():
        assert p.grad_batch.shape[0] == N, name
        assert_close(p.grad_batch, grads[name], name)
        assert_close(p.diag_ggn_exact, _diag(blocks, p, name), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)
