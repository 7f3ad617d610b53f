"""Exact curvature of language models from ``d`` columns per loss row below the head
(``curvopt.engine.compress``): the quantities equal torch.func references in float64 where
the columns are compressed (asserted by counting the columns propagated below the head's input), and
where they must not be (``V <= d``, a path around the head's input, mixing above it)."""

import collections

import pytest
import torch
from conftest import assert_close, trainable
from reference import ggn, hessian, kronecker
from torch import nn
from torch.utils.checkpoint import checkpoint

import curvopt
from curvopt import extensions as ext
from curvopt.engine import compress
from curvopt.graph import propagate
from curvopt.core.layouts import RowLayout
from fixtures import zoo

N, T, D = 3, 4, 8


class Untied(nn.Module):
    """``zoo.GPT`` with its own output layer (no weight shared across the head's input);
    ``checkpointed``: its block in a reentrant ``torch.utils.checkpoint``."""

    def __init__(self, vocab):
        super().__init__()
        self.gpt = zoo.GPT(vocab=vocab, d=D, heads=2, t_max=T)
        self.gpt.head = nn.Linear(D, vocab)
        self.checkpointed = False

    def forward(self, idx):
        if not self.checkpointed:
            return self.gpt(idx)
        g = self.gpt
        x = g.tok(idx) + g.pos(torch.arange(idx.shape[1]))
        return g.head(g.ln_f(checkpoint(g.block, x, use_reentrant=True)))


class MixT(nn.Module):
    """A linear map over the positions of ``[N, T, F]`` (mixes positions, like attention)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(T, T)

    def forward(self, x):
        return self.lin(x.transpose(1, 2)).transpose(1, 2)


class Decoder(nn.Module):
    """Position-wise layers around a position mixer, no LayerNorm (``DiagHessian`` supports
    it); ``skip``: the head's output plus a tensor below its input (a path around it);
    ``mix_top``: positions mixed again after the head (the loss input's last call mixes)."""

    def __init__(self, vocab, skip=False, mix_top=False):
        super().__init__()
        self.inp, self.mix, self.fc = nn.Linear(5, D), MixT(), nn.Linear(D, D)
        self.head = nn.Linear(D, vocab)
        self.skip = skip
        self.top = MixT() if mix_top else None

    def forward(self, x):
        a = self.mix(torch.tanh(self.inp(x)))
        out = self.head(torch.tanh(self.fc(a)))
        if self.skip:  # functional: the head stays the one last call
            out = out + a.repeat(1, 1, -(-out.shape[-1] // D))[..., : out.shape[-1]]
        return out if self.top is None else self.top(out)


def _gpt_batch(vocab, reduction="mean"):
    gen = torch.Generator().manual_seed(1)
    idx = torch.randint(vocab, (N, T), generator=gen)
    y = torch.randint(vocab, (N, T), generator=gen)
    y[0, -1] = -100  # an ignored row: zero columns, compressed as zeros
    return idx, y


def _decoder_batch(vocab, reduction="mean"):
    gen = torch.Generator().manual_seed(1)
    return torch.randn(N, T, 5, generator=gen, dtype=torch.float64), torch.randint(
        vocab, (N, T), generator=gen
    )


def _loss_on(reduction):
    lossfunc = nn.CrossEntropyLoss(reduction=reduction)
    return lambda out, y: lossfunc(out.reshape(-1, out.shape[-1]), y.reshape(-1))


@pytest.fixture
def counted(monkeypatch):
    """``[(root is the loss input, columns)]`` of every ``propagate.backpropagate`` call."""
    seen = []
    plain = propagate.backpropagate

    def counting(outputs, edges, columns, batched, walk):
        seen.append((outputs, columns.shape[0]))
        return plain(outputs, edges, columns, batched, walk)

    monkeypatch.setattr(propagate, "backpropagate", counting)
    return seen


def _run(model, X, y, reduction, extension):
    torch.manual_seed(0)
    model = curvopt.extend(model.double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    head = model.gpt.head if isinstance(model, Untied) else model.head
    inputs = []
    handle = head.register_forward_pre_hook(lambda m, args: inputs.append(args[0]))
    logits = model(X)
    handle.remove()
    with curvopt.collect(extension):
        lossfunc(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
    return model, inputs[0].grad_fn


def _below(seen, head_input):
    """Columns of the propagations that start at the head's input (node ``head_input``, or a
    view of it: a head found in the graph, whose input is its ``[R, d]`` view)."""

    def starts_at_h(root):
        node = root.grad_fn if isinstance(root, torch.Tensor) else root.node
        return node is head_input or (
            type(node).__name__ == "ViewBackward0" and node.next_functions[0][0] is head_input
        )

    return [k for root, k in seen if starts_at_h(root)]


def _diag_reference(model, X, y, reduction, kind):
    if kind == "DiagHessian":
        return hessian(model, _loss_on(reduction), X, y)[0]
    blocks, per_sample = ggn(model, _loss_on(reduction), X, y)
    if kind == "BatchDiagGGNExact":
        return per_sample
    return {k: torch.diagonal(b).reshape(per_sample[k].shape[1:]) for k, b in blocks.items()}


_DIAGONALS = {
    "DiagGGNExact": (ext.DiagGGNExact, "diag_ggn_exact"),
    "BatchDiagGGNExact": (ext.BatchDiagGGNExact, "diag_ggn_exact_batch"),
    "DiagHessian": (ext.DiagHessian, "diag_h"),
}


def _check_diagonal(make_model, batch, vocab, reduction, kind, counted):
    torch.manual_seed(0)
    plain = make_model().double()
    X, y = batch(vocab)
    expected = _diag_reference(plain, X, y, reduction, kind)
    make, attr = _DIAGONALS[kind]
    model, head_input = _run(plain, X, y, reduction, make())
    for name, p in trainable(model).items():
        assert_close(getattr(p, attr), expected[name], f"{kind} {name}")
    return _below(counted, head_input)


def _check_kflr(make_model, batch, vocab, reduction, counted):
    torch.manual_seed(0)
    plain = make_model().double()
    X, y = batch(vocab)
    expected = kronecker(plain, _loss_on(reduction), X, y)
    model, head_input = _run(plain, X, y, reduction, ext.KFLR())
    modules = dict(model.named_modules())
    uses = collections.Counter(
        id(m.weight)
        for m in modules.values()
        if isinstance(getattr(m, "weight", None), nn.Parameter)
    )
    checked = 0
    for name, (b, a) in expected.items():
        weight = modules[name].weight
        if uses[id(weight)] > 1:
            continue  # tied (embedding and head): the nearest Kronecker product of both uses
        factors = [a, b] if isinstance(modules[name], nn.Embedding) else [b, a]  # weight order
        assert_close(weight.kflr[0], factors[0], f"KFLR {name} [0]")
        assert_close(weight.kflr[1], factors[1], f"KFLR {name} [1]")
        checked += 1
    assert checked >= 3
    return _below(counted, head_input)


def _compressed(below, vocab):
    """The propagations below the head's input carry ``d`` columns per slot, not ``V``."""
    assert below, "no propagation started at the head's input: nothing was compressed"
    assert max(below) <= D * T < vocab * T, below


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["DiagGGNExact", "BatchDiagGGNExact"])
def test_untied_gpt_diagonals_are_exact_from_compressed_columns(kind, reduction, counted):
    vocab = 20
    below = _check_diagonal(lambda: Untied(vocab), _gpt_batch, vocab, reduction, kind, counted)
    _compressed(below, vocab)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["DiagGGNExact", "BatchDiagGGNExact", "DiagHessian"])
def test_decoder_diagonals_are_exact_from_compressed_columns(kind, reduction, counted):
    vocab = 20
    below = _check_diagonal(lambda: Decoder(vocab), _decoder_batch, vocab, reduction, kind, counted)
    _compressed(below, vocab)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_gpt_kflr_is_exact_from_compressed_columns(tied, reduction, counted):
    """KFLR compresses with the head tied to the embedding too: each call's factor is its own."""
    vocab = 20
    make = (lambda: zoo.GPT(vocab=vocab, d=D, heads=2, t_max=T)) if tied else lambda: Untied(vocab)
    below = _check_kflr(make, _gpt_batch, vocab, reduction, counted)
    _compressed(below, vocab)


def _frozen_head(model):
    """Every parameter outside Linear layers frozen, the head tied to the embedding too."""
    linear = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    embedded = {
        id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()
    }
    for p in model.parameters():
        p.requires_grad_(id(p) in linear and id(p) not in embedded)
    return model


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("tied_linear", [True, False], ids=["head module", "functional head"])
def test_frozen_head_gpt_kflr_is_exact_from_compressed_columns(tied_linear, reduction, counted):
    """The head's weight needs no gradient (no call records it): the cut at its input is found
    in the graph, ``h Wᵀ`` up to views, and the block's Linear layers get exact factors."""
    vocab = 20
    torch.manual_seed(0)
    plain = zoo.GPT(vocab=vocab, d=D, heads=2, t_max=T, tied_linear=tied_linear).double()
    X, y = _gpt_batch(vocab)
    expected = kronecker(plain, _loss_on(reduction), X, y)  # which parameters train: no matter
    model = curvopt.extend(_frozen_head(plain))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    logits = model(X)
    h = model.ln_f(model.block(model.tok(X) + model.pos(torch.arange(T))))  # the head's input
    assert torch.equal(logits, h @ model.tok.weight.T)
    with curvopt.collect(ext.KFLR()):
        lossfunc(logits.reshape(-1, vocab), y.reshape(-1)).backward()
    checked = 0
    for name, p in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        if not p.requires_grad:
            assert not hasattr(p, "kflr"), name
        elif kind == "weight":
            b, a = expected[module_name]
            assert_close(p.kflr[0], b, f"KFLR {name} [0]")
            assert_close(p.kflr[1], a, f"KFLR {name} [1]")
            checked += 1
    assert checked == 4  # qkv, proj, fc, out
    # the propagations below the head's input: those from its [R, d] view
    below = [k for root, k in counted if not isinstance(root, torch.Tensor)]
    _compressed(below, vocab)
    # from the loss input: the V columns with all rows at once (not V per slot)
    assert max(k for root, k in counted if isinstance(root, torch.Tensor)) <= vocab


@pytest.mark.parametrize("kind", ["DiagGGNExact", "BatchDiagGGNExact"])
def test_compressed_through_a_reentrant_checkpoint_below_the_head(kind, counted):
    """The columns from the head's input cross the checkpointed block in stages."""
    vocab = 20

    def make():
        model = Untied(vocab)
        model.checkpointed = True
        return model

    torch.manual_seed(0)
    plain = Untied(vocab).double()
    X, y = _gpt_batch(vocab)
    expected = _diag_reference(plain, X, y, "mean", kind)
    torch.manual_seed(0)
    checkpointed = make().double()
    checkpointed.load_state_dict(plain.state_dict())
    model, head_input = _run(checkpointed, X, y, "mean", _DIAGONALS[kind][0]())
    for name, p in trainable(model).items():
        assert_close(getattr(p, _DIAGONALS[kind][1]), expected[name], f"{kind} {name}")
    _compressed(_below(counted, head_input), vocab)


def test_tied_gpt_diagonal_is_exact_and_not_compressed(counted):
    """A weight used above and below the head's input: its diagonal pairs the columns of both
    uses one to one, so nothing is compressed."""
    vocab = 20
    make = lambda: zoo.GPT(vocab=vocab, d=D, heads=2, t_max=T)  # noqa: E731
    below = _check_diagonal(make, _gpt_batch, vocab, "mean", "DiagGGNExact", counted)
    assert below == []


@pytest.mark.parametrize(
    "variant",
    [
        dict(vocab=5),  # V < d: nothing to gain
        dict(vocab=20, skip=True),  # a path around the head's input
        dict(vocab=20, mix_top=True),  # positions mixed above the head
    ],
    ids=["V<d", "skip around h", "mixing above h"],
)
@pytest.mark.parametrize("kind", ["DiagGGNExact", "BatchDiagGGNExact"])
def test_not_compressed_where_it_would_be_wrong_and_still_exact(variant, kind, counted):
    vocab = variant["vocab"]
    make = lambda: Decoder(**variant)  # noqa: E731
    below = _check_diagonal(make, _decoder_batch, vocab, "mean", kind, counted)
    assert below == []


def test_not_compressed_kflr_with_a_skip_is_exact(counted):
    vocab = 20
    below = _check_kflr(lambda: Decoder(vocab, skip=True), _decoder_batch, vocab, "sum", counted)
    assert below == []


def _two_slots(rows):
    """A ``layouts.RowLayout`` of two rows per sample: row ``r`` in slot ``r % 2``."""
    return RowLayout(torch.arange(rows) // 2, rows // 2)


class _Cut:
    """A ``compress.Cut`` stand-in: ``h`` of shape ``[rows, width]``."""

    def __init__(self, rows, width):
        self.shape = (rows, width)


def test_row_factors_keep_each_rows_gram_with_width_columns():
    """Chunk by chunk as in one, each row's ``F_rᵀ F_r`` is the Gram of all its columns; the
    packed columns hold ``F_r`` at row ``r``'s position in its own slot's columns alone."""
    rows, width, k = 4, 3, 7
    gen = torch.Generator().manual_seed(0)
    at_h = torch.randn(k, rows, width, generator=gen, dtype=torch.float64)
    chunked, whole = compress.RowFactors(_Cut(rows, width), rows), None
    for part in (at_h[:2], at_h[2:5], at_h[5:]):
        chunked.add(part)
    whole = compress.RowFactors(_Cut(rows, width), rows)
    whole.add(at_h)
    for factors in (chunked, whole):
        short = factors.columns(_two_slots(rows), 0, 2, torch.float64)
        assert short.shape == (width * 2, rows, width)
        c = short.reshape(width, 2, rows, width)
        for r in range(rows):
            assert bool((c[:, 1 - r % 2, r] == 0).all())  # a row stays in its slot
            gram = c[:, r % 2, r].T @ c[:, r % 2, r]
            expected = at_h[:, r].T @ at_h[:, r]
            torch.testing.assert_close(gram, expected, rtol=1e-12, atol=1e-14)
    one_slot = whole.columns(_two_slots(rows), 1, 2, torch.float32)  # slot 1 alone, cast
    assert one_slot.dtype == torch.float32 and one_slot.shape == (width, rows, width)
    assert bool((one_slot[:, 0::2] == 0).all()) and bool((one_slot[:, 1::2] != 0).any())


def test_row_probes_tell_every_pair_of_rows_apart():
    root = torch.randn(12, 5, dtype=torch.float64)
    probes, sets = compress.row_probes(root)
    assert probes.shape == (sets.shape[0], 12, 5) and probes.dtype == torch.float64
    assert bool((probes[~sets] == 0).all()) and bool((probes[sets] != 0).all())
    for r in range(12):
        for q in range(12):
            assert r == q or bool((sets[:, r] & ~sets[:, q]).any())
    again, _ = compress.row_probes(root)
    assert torch.equal(probes, again)  # a private, seeded generator


def test_row_local_refuses_a_leak_or_changed_head_columns():
    root = torch.randn(6, 5, dtype=torch.float64)
    probes, sets = compress.row_probes(root)
    weight = torch.randn(5, 3, dtype=torch.float64)
    at_h = probes @ weight  # a position-wise head's backward: row r to position r
    assert compress.row_local(probes, sets, probes, at_h)
    mixed = at_h.roll(1, dims=1)  # row r's columns at position r + 1
    assert not compress.row_local(probes, sets, probes, mixed)
    leaked = at_h.clone()
    leaked[:, 0] += 1e-9 * at_h[:, 1]  # a trace of row 1 at position 0
    assert not compress.row_local(probes, sets, probes, leaked)
    changed = probes.clone()
    changed[0, 0, 0] += 1.0  # the head's output is not the loss input unchanged
    assert not compress.row_local(probes, sets, changed, at_h)
    assert not compress.row_local(probes, sets, probes, None)
