"""``torch.utils.checkpoint(..., use_reentrant=True)`` (issue 21, item 2): curvature through the
segments curvopt re-runs (``curvopt.graph.checkpointing``), in float64, equal to the same
model without checkpoints (curvopt) and to torch.func references; the cases it cannot do raise
naming the fix, with nothing written.

Each model runs its blocks through ``checkpoint`` or, with ``mode=None``, directly (the
reference: torch.func refuses checkpoints). The dropout and MC cases draw the same random
numbers either way: the forward draws in the same order, curvopt's re-run restores the
forward's RNG state and leaves the global generator as it was.
"""

import copy
import gc

import pytest
import torch
from conftest import (
    ALL_ATTRS,
    DT,
    assert_close,
    assert_no_attributes,
    clear_attributes,
    ggn_reference,
    hessian_reference,
)
from reference import kfra_mlp, kronecker, per_sample_grads
from torch import nn
from torch.utils.checkpoint import checkpoint

import curvopt
from curvopt.core.extended import live_calls
from curvopt.graph import checkpointing
from curvopt import extensions as ext
from curvopt.errors import UnsupportedModuleError

N, T, C = 3, 4, 7


def _ckpt(mode, fn, *args, preserve=True):
    if mode is None:
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=True, preserve_rng_state=preserve)


class Chain(nn.Module):
    """Tokens ``[N, T]`` (or features ``[N, 4]``) -> tanh -> two checkpointed blocks with a tanh
    between them (curved ops feeding and fed by a checkpoint) -> head."""

    def __init__(self, mode, tokens=True, nested=False):
        super().__init__()
        self.emb = nn.Embedding(C, 4) if tokens else nn.Linear(4, 4)
        self.mid, self.mid2, self.head = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, C)
        self.mode, self.nested = mode, nested

    def b1(self, h):
        return torch.tanh(self.mid(h))

    def b2(self, h):
        return torch.sigmoid(self.mid2(h))

    def both(self, h):  # a curved op between the checkpoints (DiagHessian's residual source)
        return _ckpt(self.mode, self.b2, torch.tanh(_ckpt(self.mode, self.b1, h)))

    def forward(self, x):
        h = torch.tanh(self.emb(x))
        if self.nested:  # a checkpoint whose segment holds two checkpoints
            return self.head(_ckpt(self.mode, self.both, h))
        return self.head(self.both(h))


class Block(nn.Module):
    """A transformer-like block: residual and a multi-output split inside the checkpoint, a
    non-tensor argument, a mask that does not require grad, dropout."""

    def __init__(self, mode, p=0.0, preserve=True):
        super().__init__()
        self.emb, self.up = nn.Embedding(C, 4), nn.Linear(4, 6)
        self.down, self.head = nn.Linear(3, 4), nn.Linear(4, C)
        self.drop = nn.Dropout(p)
        self.mode, self.preserve = mode, preserve

    def block(self, h, mask, scale):
        a, b = self.up(h).chunk(2, dim=-1)
        u = self.drop(torch.tanh(a) * mask + scale * b)
        return h + self.down(u), a

    def forward(self, x):
        h = self.emb(x)
        mask = (x % 2 == 0).to(h.dtype)[..., None]
        out, a = _ckpt(self.mode, self.block, h, mask, 0.5, preserve=self.preserve)
        return self.head(out) + 0.1 * a.sum(-1, keepdim=True)


def _data(tokens=True):
    torch.manual_seed(0)
    if tokens:
        return torch.randint(0, C, (N, T)), torch.randint(0, C, (N, T))
    return torch.randn(N, 4, dtype=DT), torch.randint(0, C, (N,))


def loss_on(out, y, reduction="mean"):
    return nn.functional.cross_entropy(out.reshape(-1, C), y.reshape(-1), reduction=reduction)


def _run(model, x, y, exts, reduction="mean", seed=3):
    """Fresh attributes; one forward and backward inside ``collect`` (the RNG seeded first)."""
    clear_attributes(model, ALL_ATTRS)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    torch.manual_seed(seed)
    out = model(x)
    with curvopt.collect(*exts):
        lossfunc(out.reshape(-1, C), y.reshape(-1)).backward()
    return model


def _pair(cls, *args, **kwargs):
    torch.manual_seed(1)
    checked = cls(True, *args, **kwargs).to(DT)
    plain = copy.deepcopy(checked)
    plain.mode = None
    return curvopt.extend(checked), plain


def _attrs(model, attrs):
    return {n: {a: getattr(p, a) for a in attrs} for n, p in model.named_parameters()}


def _same(checked, plain_extended, attrs):
    got, want = _attrs(checked, attrs), _attrs(plain_extended, attrs)
    for name in want:
        for attr in attrs:
            a, b = got[name][attr], want[name][attr]
            if isinstance(b, list):
                assert len(a) == len(b), (name, attr)
                for u, v in zip(a, b):
                    assert_close(u, v, f"{name}.{attr}")
            else:
                assert_close(a, b, f"{name}.{attr}")


def _no_live_state(model):
    """No re-run segment outlives its pass (each is its walk's, released at the end), and no
    call of ``model`` awaits its gradients. The full collection (slow on the suite's large heap)
    runs only when one is still reachable: it can free them, never revive one."""
    segments = any(isinstance(o, checkpointing.Segment) for o in gc.get_objects())
    if segments or any(live_calls(m) != 0 for m in model.modules()):
        gc.collect()
        assert not any(isinstance(o, checkpointing.Segment) for o in gc.get_objects())
        for m in model.modules():
            assert live_calls(m) == 0, m


EXACT = (ext.DiagGGNExact, ext.BatchDiagGGNExact, ext.KFLR, ext.BatchGrad)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tokens", [True, False])
@pytest.mark.parametrize("nested", [False, True])
def test_chain_against_torch_func(tokens, nested, reduction):
    """Two checkpoints in a row (or inside a third): GGN and Hessian diagonals (summed and per
    sample), KFLR and per-sample gradients, against torch.func on the model without them."""
    checked, plain = _pair(Chain, tokens, nested)
    x, y = _data(tokens)
    exts = [e() for e in EXACT] + [ext.DiagHessian(), ext.BatchDiagHessian()]
    for _ in range(2):  # the second pass reuses nothing of the first
        _run(checked, x, y, exts, reduction)
        _no_live_state(checked)

    def lf(o, t):
        return loss_on(o, t, reduction)

    blocks, per_sample = ggn_reference(plain, lf, x, y)
    diag_h, per_sample_h = hessian_reference(plain, lf, x, y)
    grads = per_sample_grads(plain, lf, x, y)
    for name, p in checked.named_parameters():
        assert_close(p.grad_batch, grads[name], name)
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)
        assert_close(p.diag_h, diag_h[name], name)
        assert_close(p.diag_h_batch, per_sample_h[name], name)
    kron = kronecker(plain, lf, x, y, types=(nn.Linear,))
    for name in ("mid", "mid2", "head"):
        b, a = kron[name]
        weight = getattr(checked, name).weight
        assert_close(weight.kflr[0], b, name)
        assert_close(weight.kflr[1], a, name)


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_block_against_the_unchecked_model(p):
    """Residual, chunk, a mask, a scalar argument, two outputs, dropout in train mode (the
    re-run restores the forward's RNG state): every curvature quantity of the model without
    checkpoint, with the same random numbers (MC targets included)."""
    checked, plain = _pair(Block, p)
    reference = curvopt.extend(plain)
    x, y = _data()
    attrs = ["diag_ggn_exact", "diag_ggn_mc", "kflr", "kfac", "grad_batch", "variance"]
    exts = [
        ext.DiagGGNExact(),
        ext.DiagGGNMC(mc_samples=3),
        ext.KFLR(),
        ext.KFAC(),
        ext.BatchGrad(),
        ext.Variance(),
    ]
    for seed in (3, 4):
        _run(checked, x, y, exts, seed=seed)
        _run(reference, x, y, exts, seed=seed)
        _same(checked, reference, attrs)
        _no_live_state(checked)
    blocks, _ = ggn_reference(plain.eval(), loss_on, x, y)  # no dropout in torch.func: p=0 only
    if p == 0.0:
        for name, q in checked.named_parameters():
            assert_close(q.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(q.shape), name)


def test_global_generator_untouched():
    """curvopt's re-run of a dropout segment leaves the global RNG where torch's own would."""
    checked, _ = _pair(Block, 0.4)
    x, y = _data()
    plain_run = copy.deepcopy(checked)
    _run(checked, x, y, [ext.DiagGGNExact()])
    after_curvopt = torch.rand(3)
    torch.manual_seed(3)
    loss_on(plain_run(x), y).backward()
    assert torch.equal(after_curvopt, torch.rand(3))


class Mlp(nn.Module):
    """``Linear - Tanh - [Linear - Sigmoid] - Linear`` with the bracket checkpointed; with
    ``mode=None`` the same modules as a plain ``nn.Sequential`` (for the KFRA reference)."""

    def __init__(self, mode):
        super().__init__()
        self.layers = nn.Sequential(
            nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 6), nn.Sigmoid(), nn.Linear(6, 3)
        )
        self.mode = mode

    def forward(self, x):
        h = self.layers[1](self.layers[0](x))
        h = _ckpt(self.mode, self.layers[2:4], h)
        return self.layers[4](h)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kfra_through_a_checkpoint(reduction):
    """The recursion crosses the checkpoint: the unchecked model's factors, and Botev et al.'s
    ``B_l`` from the torch.func-free reference."""
    checked, plain = _pair(Mlp)
    reference = curvopt.extend(copy.deepcopy(plain))
    x, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    for model in (checked, reference):
        clear_attributes(model, ALL_ATTRS)
        lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
        with curvopt.collect(ext.KFRA()):
            lossfunc(model(x), y).backward()
    _same(checked, reference, ["kfra"])
    factors = kfra_mlp(
        plain.layers, lambda o, t: nn.functional.cross_entropy(o, t, reduction=reduction), x, y
    )
    for i, b in zip((0, 2, 4), factors):
        assert_close(checked.layers[i].weight.kfra[0], b, f"layers.{i}")
    _no_live_state(checked)


def test_two_extended_losses():
    """The checkpoint's gradient check sums the shares of both losses."""
    checked, plain = _pair(Chain, False)
    reference = curvopt.extend(plain)
    x, y = _data(False)
    ce, mse = curvopt.extend(nn.CrossEntropyLoss()), curvopt.extend(nn.MSELoss())
    target = torch.randn(N, C, dtype=DT)
    for model in (checked, reference):
        clear_attributes(model, ALL_ATTRS)
        out = model(x)
        with curvopt.collect(ext.DiagGGNExact(), ext.KFLR()):
            (ce(out, y) + 0.5 * mse(out, target)).backward()
    _same(checked, reference, ["diag_ggn_exact", "kflr"])
    _no_live_state(checked)


# ------------------------------------------------------------------ what raises
class Bypass(nn.Module):
    """``h + checkpoint(f, h)``: the residual around the checkpoint."""

    def __init__(self, mode):
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(C, 4), nn.Linear(4, 4), nn.Linear(4, C)
        self.mode = mode

    def f(self, h):
        return torch.tanh(self.mid(h))

    def forward(self, x):
        h = self.emb(x)
        return self.head(h + _ckpt(self.mode, self.f, h))


def _raises(model, x, y, exts, match):
    with pytest.raises(UnsupportedModuleError, match=match):
        _run(model, x, y, exts)
    assert_no_attributes(model)
    _no_live_state(model)


@pytest.mark.parametrize("extension", [ext.DiagGGNExact, ext.KFLR, ext.DiagHessian])
def test_residual_around_the_checkpoint_raises(extension):
    checked, _ = _pair(Bypass)
    x, y = _data()
    _raises(checked, x, y, [extension()], r"around it.*use_reentrant=False")
    # first order still works there
    _run(checked, x, y, [ext.BatchGrad()])
    assert checked.mid.weight.grad_batch.shape == (N, 4, 4)


def test_unpreserved_rng_with_dropout_raises():
    checked, _ = _pair(Block, 0.4, preserve=False)
    x, y = _data()
    _raises(checked, x, y, [ext.DiagGGNExact()], r"preserve_rng_state=True")


def test_unpreserved_rng_without_randomness_works():
    checked, plain = _pair(Block, 0.0, preserve=False)
    reference = curvopt.extend(plain)
    x, y = _data()
    _run(checked, x, y, [ext.DiagGGNExact()])
    _run(reference, x, y, [ext.DiagGGNExact()])
    _same(checked, reference, ["diag_ggn_exact"])


def test_penalty_on_the_checkpoint_output_raises():
    """A term on the segment's output that no extended loss made is caught at the checkpoint
    (the calls inside it see their gradients only in torch's own re-run)."""
    checked, _ = _pair(Chain)
    x, y = _data()
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    clear_attributes(checked, ALL_ATTRS)
    h = checked.emb(x)
    inner = checkpoint(checked.b1, h, use_reentrant=True)
    out = checked.head(checkpoint(checked.b2, inner, use_reentrant=True))
    loss = lossfunc(out.reshape(-1, C), y.reshape(-1)) + 0.1 * (inner**2).sum()
    with pytest.raises(UnsupportedModuleError, match=r"checkpoint\(Chain\.b1\).*extended loss"):
        with curvopt.collect(ext.DiagGGNExact()):
            loss.backward()
    assert_no_attributes(checked)
    _no_live_state(checked)


# ------------------------------------------------------------------ Hugging Face
def _checkpoints(t):
    """How many reentrant checkpoint nodes lie upstream of ``t``."""
    stack, seen = [t.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is not None and node not in seen:
            seen.add(node)
            stack.extend(fn for fn, _ in node.next_functions)
    return sum(type(node).__name__ == "CheckpointFunctionBackward" for node in seen)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_hugging_face_gradient_checkpointing(name):
    """``model.gradient_checkpointing_enable(use_reentrant=True)`` on tiny GPT-2 / Llama (training
    mode, where HF checkpoints; no dropout): the numbers of the same model without it (which
    ``test_hf_models.py`` checks against torch.func)."""
    hf = pytest.importorskip("test_hf_models")
    torch.manual_seed(0)
    base = getattr(hf, name)().to(DT)
    attrs = ["diag_ggn_exact", "kflr", "grad_batch"]
    models = []
    for checked in (True, False):
        model = copy.deepcopy(base)
        if checked:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": True}
            )
        model = curvopt.extend(model.train())
        inputs, y = hf._text()
        out = model(**inputs).logits
        assert _checkpoints(out) == (base.config.num_hidden_layers if checked else 0)
        with curvopt.collect(ext.DiagGGNExact(), ext.KFLR(), ext.BatchGrad()):
            hf._loss_of("lm")(out, y).backward()
        models.append(model)
    _same(*models, attrs)
    _no_live_state(models[0])
