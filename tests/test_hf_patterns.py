"""The Hugging Face / timm patterns of issue 21, reproduced in plain torch (no transformers).

* a bias held by a parent module and tied to ``decoder.bias`` (BERT's masked-LM head);
* position embeddings of a shared ``arange`` under a loss that is not extended (HF ``labels=``);
* a ViT (class token and position embeddings as raw 3-D parameters): ``collect``'s
  ``skip_unsupported`` opt-in and ``optim.KFAC``'s ``fallback``;
* dict inputs and ``ModelOutput``-like outputs in ``verify`` and ``linalg``.
"""

from __future__ import annotations

import copy
import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F
from conftest import (
    DT,
    assert_close,
    check_against_loop,
    extended_copy,
    ggn_reference,
    hessian_reference,
)
from torch import nn

import curvopt
from curvopt import extensions as ext


# ------------------------------------------------------------------------------ tied bias
class Head(nn.Module):
    """BERT's ``LMPredictionHead`` layout: ``bias`` held here and as ``decoder.bias``."""

    def __init__(self, d, v):
        super().__init__()
        self.decoder = nn.Linear(d, v, bias=False)
        self.bias = nn.Parameter(torch.randn(v) * 0.3)
        self.decoder.bias = self.bias

    def forward(self, h):
        return self.decoder(h)


def _tied():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), Head(5, 3)).to(DT)


def test_tied_bias_first_order():
    plain = _tied()
    names = [n for n, _ in plain.named_parameters()]
    assert "2.bias" in names and "2.decoder.bias" not in names  # listed under the parent
    X, y = torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,))
    for reduction in ("mean", "sum"):
        check_against_loop(plain, nn.CrossEntropyLoss(reduction=reduction), X, y)


def test_tied_bias_second_order():
    plain = _tied()
    X, y = torch.randn(3, 4, dtype=DT), torch.randint(0, 3, (3,))
    loss = nn.CrossEntropyLoss()
    blocks, per_sample = ggn_reference(plain, loss, X, y)
    hdiag, _ = hessian_reference(plain, loss, X, y)
    model, lossfunc = extended_copy(plain), curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact(), ext.DiagHessian()):
        lossfunc(model(X), y).backward()
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)
        assert_close(p.diag_h, hdiag[name], name)
    X1, y1 = X[:1], y[:1]
    blocks, _ = ggn_reference(plain, loss, X1, y1)
    with curvopt.collect(ext.KFLR()):
        lossfunc(model(X1), y1).backward()
    assert_close(model[2].bias.kflr[0], blocks["2.bias"], "tied bias KFLR")


def test_a_parent_using_the_tied_bias_itself_still_raises():
    """Ownership goes to the child; a second, direct use by the parent is seen by the sums."""

    class Twice(Head):
        def forward(self, h):
            return self.decoder(h) + self.bias

    model = curvopt.extend(nn.Sequential(nn.Linear(4, 5), Twice(5, 3)).to(DT))
    X, y = torch.randn(4, 4, dtype=DT), torch.randint(0, 3, (4,))
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="outside the module"):
        with curvopt.collect(ext.BatchGrad()):
            F.cross_entropy(model(X), y).backward()
    assert not hasattr(model[1].bias, "grad_batch")


# ------------------------------------------------------------------------------ broadcast
class TinyLM(nn.Module):
    """GPT-2's embedding: ``wte(ids) + wpe(position_ids)`` with positions of a shared arange."""

    def __init__(self, v=7, d=6, t_max=8, leading=True):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(v, d), nn.Embedding(t_max, d)
        self.lin = nn.Linear(d, v)
        self.leading = leading

    def forward(self, ids):
        positions = torch.arange(ids.shape[1])
        if self.leading:
            positions = positions.unsqueeze(0)  # [1, T], as HF builds them
        return self.lin(torch.tanh(self.wte(ids) + self.wpe(positions)))


@pytest.mark.parametrize("leading", [True, False])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_broadcast_positions_under_a_plain_loss(leading, reduction):
    """HF's ``labels=`` loss is not an extended module: the broadcast is still followed."""
    torch.manual_seed(0)
    plain = TinyLM(leading=leading).to(DT)
    ids = torch.randint(0, 7, (3, 5))

    def loss(out, y):  # functional, as HF computes it
        return F.cross_entropy(out.flatten(0, 1), y.flatten(), reduction=reduction)

    check_against_loop(plain, loss, ids, ids)


# ------------------------------------------------------------------------------ ViT stand-in
class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))

    def forward(self, x):
        n, t, d = x.shape

        def split(h):
            return h.reshape(n, t, self.heads, -1).transpose(1, 2)

        a = F.scaled_dot_product_attention(split(self.q(x)), split(self.k(x)), split(self.v(x)))
        return self.o(a.transpose(1, 2).reshape(n, t, d))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.mlp = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Embeddings(nn.Module):
    """HF ``ViTEmbeddings``: patches by a convolution, a class token, position embeddings."""

    def __init__(self, d, patch, image):
        super().__init__()
        self.patch = nn.Conv2d(3, d, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, d) * 0.1)
        self.position_embeddings = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, d) * 0.1)

    def forward(self, images):
        x = self.patch(images).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], 1)
        return x + self.position_embeddings


class ViT(nn.Module):
    """A plain-torch stand-in for HF's / timm's ViT (timm needs torchvision, not importable
    beside this torch)."""

    def __init__(self, d=16, heads=2, depth=2, patch=4, image=8, classes=3):
        super().__init__()
        self.embeddings = Embeddings(d, patch, image)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(depth)))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, classes)

    def forward(self, images):
        return self.head(self.norm(self.blocks(self.embeddings(images)))[:, 0])


RAW = {"embeddings.cls_token", "embeddings.position_embeddings"}


def _vit_problem(n=16):
    torch.manual_seed(0)
    model = curvopt.extend(ViT().to(DT))
    return model, torch.randn(n, 3, 8, 8, dtype=DT), torch.randint(0, 3, (n,))


def test_vit_first_order_and_diagonals_against_references():
    torch.manual_seed(0)
    plain = ViT().to(DT)
    X, y = torch.randn(3, 3, 8, 8, dtype=DT), torch.randint(0, 3, (3,))
    check_against_loop(plain, nn.CrossEntropyLoss(), X, y, attr_sets=[("grad_batch",)])
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), X, y)
    model = extended_copy(plain)
    with curvopt.collect(ext.DiagGGNExact()):
        curvopt.extend(nn.CrossEntropyLoss())(model(X), y).backward()
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)


def test_kfac_names_raw_parameters_and_the_opt_in():
    model, X, y = _vit_problem()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="skip_unsupported=True"):
        with curvopt.collect(ext.KFAC()):
            lossfunc(model(X), y).backward()
    assert not any(hasattr(p, "kfac") for p in model.parameters())


def test_skip_unsupported_skips_exactly_the_raw_parameters_and_says_so():
    """Skipped parameters get the diagonal of the same curvature instead: for KFLR the exact
    GGN diagonal (checked against torch.func)."""
    torch.manual_seed(0)
    plain = ViT().to(DT)
    model = extended_copy(plain)
    X, y = torch.randn(4, 3, 8, 8, dtype=DT), torch.randint(0, 3, (4,))
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), X, y)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with pytest.warns(UserWarning, match="cls_token"):
        with curvopt.collect(ext.KFLR(), ext.BatchGrad(), skip_unsupported="diagonal") as ctx:
            lossfunc(model(X), y).backward()
    assert set(ctx.skipped) == RAW
    for name, p in model.named_parameters():
        assert hasattr(p, "kflr") == (name not in RAW), name
        assert hasattr(p, "kflr_diagonal") == (name in RAW), name
        assert p.grad_batch.shape == (4, *p.shape)  # other quantities are untouched
        if name in RAW:
            want = torch.diagonal(blocks[name]).reshape(p.shape)
            assert_close(p.kflr_diagonal, want, name)
    with warnings.catch_warnings():  # nothing to skip: no warning
        warnings.simplefilter("error")
        mlp = curvopt.extend(nn.Sequential(nn.Linear(4, 3)).to(DT))
        with curvopt.collect(ext.KFLR(), skip_unsupported=True) as ctx:
            lossfunc(mlp(torch.randn(2, 4, dtype=DT)), torch.tensor([0, 1])).backward()
    assert ctx.skipped == {}


def test_skipped_kfac_diagonal_is_the_monte_carlo_ggn_diagonal():
    """KFAC's sampled columns give DiagGGNMC's estimate: the same draws, the same numbers."""
    model, X, y = _vit_problem(n=4)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    torch.manual_seed(5)
    with pytest.warns(UserWarning):
        with curvopt.collect(ext.KFAC(mc_samples=3), skip_unsupported="diagonal"):
            lossfunc(model(X), y).backward()
    torch.manual_seed(5)
    with curvopt.collect(ext.DiagGGNMC(mc_samples=3)):
        lossfunc(model(X), y).backward()
    for name in RAW:
        p = model.get_parameter(name)
        assert_close(p.kfac_diagonal, p.diag_ggn_mc, name)


def test_skip_rejects_a_raw_parameter_used_by_two_calls():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(2, 4, dtype=DT))

        def forward(self, x):
            return x * self.w

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale, self.lin = Scale(), nn.Linear(4, 3).to(DT)

        def forward(self, x):
            return self.lin(self.scale(self.scale(x)).sum(1))

    model = curvopt.extend(Net())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x = torch.randn(3, 2, 4, dtype=DT)
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="several"):
        with curvopt.collect(ext.KFLR(), skip_unsupported="diagonal"):
            lossfunc(model(x), torch.tensor([0, 1, 2])).backward()
    assert not hasattr(model.lin.weight, "kflr")


def _train(fallback, steps=30, lr=0.05, damping=0.1):
    model, X, y = _vit_problem()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = curvopt.optim.KFAC(model.parameters(), lr=lr, damping=damping, fallback=fallback)
    losses = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for _ in range(steps):
            opt.zero_grad()
            loss = lossfunc(model(X), y)
            with opt.collect():
                loss.backward()
            opt.step()
            losses.append(float(loss.detach()))
    return model, opt, losses


def test_optim_kfac_without_fallback_raises_naming_the_parameter():
    model, X, y = _vit_problem()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = curvopt.optim.KFAC(model.parameters(), lr=0.05, damping=0.1, fallback=None)
    with pytest.raises(
        curvopt.errors.UnsupportedModuleError, match="cls_token.*fallback='diagonal'"
    ):
        with opt.collect():
            lossfunc(model(X), y).backward()


@pytest.mark.parametrize("fallback", ["diagonal", "sgd"])
def test_optim_kfac_trains_a_vit_with_a_fallback(fallback):
    model, opt, losses = _train(fallback)
    assert losses[-1] < 0.5 * losses[0], losses
    cls = model.embeddings.cls_token
    assert ("fallback_diagonal" in opt.state[cls]) == (fallback == "diagonal")
    assert "curvature" not in opt.state[cls]
    assert "curvature" in opt.state[model.head.weight]


@pytest.mark.parametrize("weight_decay", [0.0, 0.3])
def test_diagonal_fallback_step_formula(weight_decay):
    """``θ ← θ − lr (g + δθ) / (c + λ + δ)`` with ``c`` the exact GGN diagonal (KFLR)."""
    torch.manual_seed(0)
    plain = ViT().to(DT)
    model = extended_copy(plain)
    X, y = torch.randn(4, 3, 8, 8, dtype=DT), torch.randint(0, 3, (4,))
    blocks, _ = ggn_reference(plain, nn.CrossEntropyLoss(), X, y)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    lr, lam = 0.3, 0.7
    opt = curvopt.optim.KFAC(
        model.parameters(),
        lr,
        lam,
        "kflr",
        weight_decay=weight_decay,
        fallback="diagonal",
        kl_clip=None,
    )
    before = {n: model.get_parameter(n).detach().clone() for n in RAW}
    with opt.collect():
        lossfunc(model(X), y).backward()
    grads = {n: model.get_parameter(n).grad.clone() for n in RAW}
    with pytest.warns(UserWarning, match="cls_token"):  # announced once, at the first step
        opt.step()
    for name in RAW:
        c = torch.diagonal(blocks[name]).reshape(before[name].shape)
        g = grads[name] + weight_decay * before[name]
        want = before[name] - lr * g / (c + lam + weight_decay)
        assert_close(model.get_parameter(name).detach(), want, name)


def test_skip_without_diagonal_writes_none_and_bad_values_are_rejected():
    model, X, y = _vit_problem(n=4)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with pytest.warns(UserWarning):
        with curvopt.collect(ext.KFLR(), skip_unsupported=True) as ctx:
            lossfunc(model(X), y).backward()
    assert set(ctx.skipped) == RAW
    assert not any(hasattr(p, "kflr_diagonal") for p in model.parameters())
    with pytest.raises(ValueError, match="skip_unsupported"):
        curvopt.collect(ext.KFLR(), skip_unsupported="yes")


def test_invalid_fallback_rejected():
    with pytest.raises(ValueError, match="fallback"):
        curvopt.optim.KFAC([nn.Parameter(torch.zeros(2))], lr=0.1, damping=0.1, fallback="x")
    with pytest.raises(ValueError, match="fallback"):
        curvopt.optim.DiagGGNNewton([nn.Parameter(torch.zeros(2))], 0.1, 0.1, fallback="diagonal")


# ------------------------------------------------------------------------------ dicts, ModelOutput
@dataclasses.dataclass
class Output:
    logits: torch.Tensor
    hidden: torch.Tensor = None


class DictOutput(dict):
    """A ``ModelOutput``-like dict subclass (keys, and attributes as HF's have)."""

    def __getattr__(self, name):
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def __setattr__(self, name, value):
        self[name] = value


class KeywordModel(nn.Module):
    """Called as ``model(input_ids=..., attention_mask=...)``; the mask is per sample."""

    def __init__(self, wrap):
        super().__init__()
        self.lm = TinyLM()
        self.wrap = wrap

    def forward(self, input_ids, attention_mask=None, scale=1.0):
        logits = self.lm(input_ids) * scale
        if attention_mask is not None:
            logits = logits * attention_mask.unsqueeze(-1)
        return self.wrap(logits=logits, hidden=logits)


@pytest.mark.parametrize("wrap", [Output, DictOutput])
def test_verify_with_keyword_inputs_and_model_outputs(wrap):
    torch.manual_seed(0)
    model = curvopt.extend(KeywordModel(wrap).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    ids = torch.randint(0, 7, (3, 4))
    mask = torch.ones(3, 4, dtype=DT)
    mask[1, 2:] = 0

    def loss_of(out, y):
        return lossfunc(out.flatten(0, 1), y.flatten())

    inputs = {"input_ids": ids, "attention_mask": mask, "scale": 2.0}
    exts = [ext.BatchGrad(), ext.Variance(), ext.DiagGGNExact(), ext.BatchDiagGGNExact()]
    errors = curvopt.verify(model, loss_of, inputs, ids, exts)
    assert errors["lm.lin.weight"]["grad_batch"] < 1e-10
    curvopt.verify(model, loss_of, inputs, ids, exts, output="hidden")
    curvopt.verify(model, loss_of, inputs, ids, exts, output=lambda o: o.hidden * 1)
    with pytest.raises(TypeError, match="output="):
        curvopt.verify(model, loss_of, inputs, ids, exts, output="missing")


def test_verify_dict_inputs_detects_a_model_that_mixes_samples():
    class Mixing(KeywordModel):
        def forward(self, input_ids, attention_mask=None, scale=1.0):
            out = super().forward(input_ids, attention_mask, scale)
            out.logits = out.logits - out.logits.mean(0)
            return out

    model = curvopt.extend(Mixing(Output).to(DT))
    ids = torch.randint(0, 7, (3, 4))
    with pytest.raises(curvopt.VerificationError, match="grad_batch"):  # plain loss: unseen
        curvopt.verify(
            model,
            lambda o, y: F.cross_entropy(o.flatten(0, 1), y.flatten()),
            {"input_ids": ids},
            ids,
            [ext.BatchGrad()],
        )


def test_linalg_with_dict_inputs_and_model_outputs():
    """The operators on ``{"input_ids": ...}`` batches with ``.logits`` outputs equal those on
    the same model called with a tensor."""
    torch.manual_seed(0)
    keyword = curvopt.extend(KeywordModel(Output).to(DT))
    plain = curvopt.extend(copy.deepcopy(keyword.lm))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    ids = [torch.randint(0, 7, (2, 3)) for _ in range(2)]
    flat = [(i, i.flatten()) for i in ids]
    as_dict = [({"input_ids": i}, i.flatten()) for i in ids]

    def out(o):
        return o.logits.flatten(0, 1)

    def tensor_out(o):
        return o.flatten(0, 1)

    for make in (
        lambda m, d, o: curvopt.linalg.GGN(m, lossfunc, d, output=o),
        lambda m, d, o: curvopt.linalg.EmpiricalFisher(m, lossfunc, d, output=o),
        lambda m, d, o: curvopt.linalg.Diagonal(m, lossfunc, d, output=o),
        lambda m, d, o: curvopt.linalg.KFAC(m, lossfunc, d, curvature="kflr", output=o),
    ):
        a = make(keyword, as_dict, out).to_dense()
        b = make(plain, flat, tensor_out).to_dense()
        torch.testing.assert_close(torch.as_tensor(a), torch.as_tensor(b))
