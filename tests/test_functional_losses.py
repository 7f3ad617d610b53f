"""A loss the extended model computes and returns itself (``curvopt.entry.recognize``): each
functional loss gives the quantities of its extended loss module (float64, to roundoff: the
cross-entropy is read from the log-probabilities), on an MLP and a sequence model with
flattened logits, both reductions; Hugging Face's own ``labels=`` loss through an optimizer
step equals an extended-loss twin; what cannot be read exactly raises. (The model is extended
as a part of the wrapper that computes the loss, as a Hugging Face model's head is; a loss
computed from a top-level extended model's outputs is read where it is called instead:
``test_functional_losses_outside.py``.)"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import curvopt
from curvopt import extensions as E
from curvopt.errors import MissingLossError, UnsupportedLossError, UnsupportedModuleError
from curvopt.optim import KFAC, DiagGGNNewton

DT = torch.float64
N, T, V = 5, 4, 6


class Mlp(nn.Module):
    def __init__(self, out=V):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(3, 7), nn.Tanh(), nn.Linear(7, out))

    def forward(self, x):
        return self.net(x)


class Sequence(nn.Module):
    """Tokens ``[N, T]`` -> logits ``[N T, V]``, flattened as language models do."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix, self.head = nn.Embedding(V, 5), nn.Linear(5, 5), nn.Linear(5, V)

    def forward(self, x):
        return self.head(torch.tanh(self.mix(self.emb(x)))).flatten(0, 1)


class Channels(Sequence):
    """Logits ``[N, V, T]``: the classes along dim 1, positions after them."""

    def forward(self, x):
        return super().forward(x).unflatten(0, x.shape).transpose(1, 2)


class WithLoss(nn.Module):
    """The model computing its own loss from ``labels`` with ``loss_fn``, returned as a
    mapping with ``"loss"`` (``returns="tuple"``: as the first item, ``"tensor"``: alone)."""

    def __init__(self, model, loss_fn, returns="mapping"):
        super().__init__()
        self.model, self.loss_fn, self.returns = model, loss_fn, returns

    def forward(self, x, labels):
        logits = self.model(x)
        loss = self.loss_fn(logits, labels)
        if self.returns == "tensor":
            return loss
        return (loss, logits) if self.returns == "tuple" else {"loss": loss, "logits": logits}


def _mlp_data(target):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, 3, generator=g, dtype=DT)
    if target == "class":
        return x, torch.tensor([0, 3, 5, -100, 2])
    if target == "real":
        return x, torch.randn(N, V, generator=g, dtype=DT)
    return x, torch.rand(N, V, generator=g, dtype=DT)  # probabilities for BCE


def _sequence_data(target):
    g = torch.Generator().manual_seed(2)
    x = torch.randint(0, V, (N, T), generator=g)
    if target == "class":
        y = torch.randint(0, V, (N * T,), generator=g)
        y[::3] = -100  # ignored rows: rows != samples
        return x, y
    if target == "real":
        return x, torch.randn(N * T, V, generator=g, dtype=DT)
    return x, torch.rand(N * T, V, generator=g, dtype=DT)


def _channels_data(target):
    x, y = _sequence_data(target)
    if target == "class":
        return x, y.reshape(N, T)
    return x, y.reshape(N, T, V).transpose(1, 2)


ARCHITECTURES = {
    "mlp": (Mlp, _mlp_data),
    "sequence": (Sequence, _sequence_data),
    "channels": (Channels, _channels_data),
}
WEIGHT = torch.tensor([0.5, 2.0, 1.0, 3.0, 0.25, 1.5], dtype=DT)

#: name -> (functional loss (logits, y, reduction, class weights), the extended module's twin,
#: its options given the class weights)
LOSSES = {
    "cross_entropy": (
        lambda z, y, r, w: F.cross_entropy(z, y, reduction=r),
        nn.CrossEntropyLoss,
        lambda w: {},
    ),
    "cross_entropy_weight": (
        lambda z, y, r, w: F.cross_entropy(z, y, weight=w, reduction=r),
        nn.CrossEntropyLoss,
        lambda w: {"weight": w},
    ),
    "cross_entropy_ignore_7": (
        lambda z, y, r, w: F.cross_entropy(z, y.where(y >= 0, 7), ignore_index=7, reduction=r),
        nn.CrossEntropyLoss,
        lambda w: {"ignore_index": 7},
    ),
    "nll_after_log_softmax": (
        lambda z, y, r, w: F.nll_loss(F.log_softmax(z, dim=1), y, reduction=r),
        nn.CrossEntropyLoss,
        lambda w: {},
    ),
    "mse": (lambda z, y, r, w: F.mse_loss(z, y, reduction=r), nn.MSELoss, lambda w: {}),
    "bce_with_logits": (
        lambda z, y, r, w: F.binary_cross_entropy_with_logits(
            z, y, weight=_broadcast(w, z), pos_weight=2 * _broadcast(w, z), reduction=r
        ),
        nn.BCEWithLogitsLoss,
        lambda w: {"weight": w, "pos_weight": 2 * w},
    ),
}


def _broadcast(w, z):
    """The class weights ``[V]`` as they broadcast over ``z`` (classes along dim 1)."""
    return w if z.dim() == 2 else w[:, None]


TARGETS = {"mse": "real", "bce_with_logits": "probability"}


def _twin_target(name, y):
    return y.where(y >= 0, 7) if name == "cross_entropy_ignore_7" else y


def _collected(model, loss_of, ext):
    """``ext``'s attribute of every parameter after one backward of ``loss_of(model)``."""
    with curvopt.collect(ext):
        torch.manual_seed(3)  # the Monte-Carlo draws
        loss_of(model).backward()
    return [getattr(p, ext.attr) for p in model.parameters()]


def _flat(values):
    out = []
    for v in values:
        out.extend(t.reshape(-1) for t in (v if isinstance(v, (list, tuple)) else [v]))
    return torch.cat(out)


def _both(arch, name, reduction, ext, scale=1.0):
    """The functional loss's quantity and the extended module's, on the same model."""
    make, data = ARCHITECTURES[arch]
    functional, twin_type, options = LOSSES[name]
    x, y = data(TARGETS.get(name, "class"))
    torch.manual_seed(0)
    model = make().to(DT)  # extended as a part of its wrapper: its outputs are not watched
    own = curvopt.extend(WithLoss(model, lambda z, t: functional(z, t, reduction, WEIGHT) / scale))
    got = _collected(model, lambda m: own(x, y)["loss"], ext)
    weight = (
        WEIGHT if arch != "channels" or twin_type is not nn.BCEWithLogitsLoss else WEIGHT[:, None]
    )
    twin = curvopt.extend(twin_type(reduction=reduction, **options(weight)))
    y_twin = _twin_target(name, y)
    want = _collected(model, lambda m: twin(m(x), y_twin) / scale, ext)
    return _flat(got), _flat(want)


QUANTITIES = {
    "DiagGGNExact": E.DiagGGNExact,
    "KFLR": E.KFLR,
    "KFAC": E.KFAC,
    "DiagHessian": E.DiagHessian,
}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("name", sorted(LOSSES))
@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
@pytest.mark.parametrize("quantity", sorted(QUANTITIES))
def test_functional_loss_equals_the_extended_module(quantity, arch, name, reduction):
    ext = QUANTITIES[quantity]()
    if quantity == "DiagHessian" and name.startswith(("cross", "nll")):
        with pytest.raises(UnsupportedLossError, match="DiagHessian.*extend"):
            _both(arch, name, reduction, ext)
        return
    got, want = _both(arch, name, reduction, ext)
    assert want.abs().max() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)


def test_hugging_face_normalisation_of_a_sum():
    """``reduction="sum"`` divided by a count (``num_items_in_batch``): the factor arrives
    with the gradient, as for an extended loss."""
    got, want = _both("sequence", "cross_entropy", "sum", E.KFLR(), scale=7.0)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    got, _ = _both("sequence", "cross_entropy", "sum", E.DiagGGNExact(), scale=7.0)
    unscaled, _ = _both("sequence", "cross_entropy", "sum", E.DiagGGNExact())
    torch.testing.assert_close(got * 7.0, unscaled, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("returns", ["tuple", "tensor"])
def test_the_loss_returned_alone_or_first(returns):
    x, y = _mlp_data("class")
    torch.manual_seed(0)
    model = Mlp().to(DT)
    own = curvopt.extend(WithLoss(model, F.cross_entropy, returns))
    loss_of = (lambda m: own(x, y)[0]) if returns == "tuple" else (lambda m: own(x, y))
    got = _collected(model, loss_of, E.DiagGGNExact())
    twin = curvopt.extend(nn.CrossEntropyLoss())
    want = _collected(model, lambda m: twin(m(x), y), E.DiagGGNExact())
    torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-12, atol=1e-14)


def test_weighted_sum_of_two_recognised_losses():
    """``CE(z) + 0.3 MSE(z)``: two terms, as with two extended loss modules."""
    x, y = _mlp_data("class")
    target = torch.randn(N, V, dtype=DT, generator=torch.Generator().manual_seed(5))
    torch.manual_seed(0)
    model = Mlp().to(DT)
    both = lambda z, t: F.cross_entropy(z, t) + 0.3 * F.mse_loss(z, target)  # noqa: E731
    own = curvopt.extend(WithLoss(model, both, "tensor"))
    got = _collected(model, lambda m: own(x, y), E.KFLR())
    ce, mse = curvopt.extend(nn.CrossEntropyLoss()), curvopt.extend(nn.MSELoss())
    want = _collected(model, lambda m: ce(m(x), y) + 0.3 * mse(m(x), target), E.KFLR())
    torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-12, atol=1e-14)


def test_an_extended_loss_inside_the_extended_model_counts_once():
    x, y = _mlp_data("class")
    torch.manual_seed(0)
    model = Mlp().to(DT)
    twin = curvopt.extend(nn.CrossEntropyLoss())
    own = curvopt.extend(WithLoss(model, twin, "tensor"))
    got = _collected(model, lambda m: own(x, y), E.DiagGGNExact())
    want = _collected(model, lambda m: twin(m(x), y), E.DiagGGNExact())
    torch.testing.assert_close(_flat(got), _flat(want), rtol=1e-12, atol=1e-14)


#: losses whose curvature curvopt cannot read exactly from the graph: second order raises
UNREAD = {
    "label_smoothing": lambda z, y: F.cross_entropy(z, y, label_smoothing=0.1),
    "probability_targets": lambda z, y: F.cross_entropy(z, F.one_hot(y.clamp(min=0), V).to(DT)),
    "reduction_none_then_mean": lambda z, y: F.cross_entropy(z, y, reduction="none").mean(),
    "custom": lambda z, y: (z**4).mean(),
    "log_softmax_over_the_batch": lambda z, y: F.nll_loss(F.log_softmax(z, dim=0), y),
    "exp_of_the_loss": lambda z, y: torch.exp(F.cross_entropy(z, y)),
    "product_of_two_losses": lambda z, y: F.cross_entropy(z, y) * F.mse_loss(z, 0 * z.detach()),
    "classes_regrouped_after_log_softmax": lambda z, y: F.nll_loss(
        F.log_softmax(z, dim=1).reshape(2 * N, V // 2), y.repeat(2).clamp(0, 2)
    ),
}


@pytest.mark.parametrize("name", sorted(UNREAD))
def test_a_loss_not_read_exactly_raises(name):
    x, y = _mlp_data("class")
    model = Mlp().to(DT)
    own = curvopt.extend(WithLoss(model, UNREAD[name], "tensor"))
    with curvopt.collect(E.DiagGGNExact()):
        with pytest.raises(MissingLossError, match="compute_loss_func"):
            own(x, y).backward()
    assert all(not hasattr(p, "diag_ggn_exact") for p in model.parameters())


def test_a_recognised_loss_plus_an_unread_term_raises():
    """The term curvopt cannot read feeds the gradient too: the flow check raises instead of
    leaving its curvature out."""
    x, y = _mlp_data("class")
    model = Mlp().to(DT)
    loss = lambda z, t: F.cross_entropy(z, t) + (z**4).mean()  # noqa: E731
    own = curvopt.extend(WithLoss(model, loss, "tensor"))
    with curvopt.collect(E.DiagGGNExact()):
        with pytest.raises(UnsupportedModuleError, match="does not come from the extended loss"):
            own(x, y).backward()
    assert all(not hasattr(p, "diag_ggn_exact") for p in model.parameters())


# ------------------------------------------------------------------ Hugging Face's labels= loss
def _gpt2(kind):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        vocab_size=11,
        n_positions=6,
        n_embd=16,
        n_layer=1,
        n_head=2,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        num_labels=3,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = getattr(transformers, kind)(config).to(DT)
    return curvopt.extend(model)


HF_OPTIMIZERS = {
    "KFAC": lambda p: KFAC(p, lr=0.1, damping=0.1, curvature="kfac"),
    "DiagGGNNewton": lambda p: DiagGGNNewton(p, lr=0.1, damping=0.1, curvature="exact"),
}


def _hf_batches(kind):
    g = torch.Generator().manual_seed(4)
    for _ in range(2):
        tokens = torch.randint(1, 11, (4, 5), generator=g)
        if kind == "GPT2LMHeadModel":
            labels = tokens.clone()
            labels[:, :2] = -100  # a prompt without loss
        else:
            labels = torch.randint(0, 3, (4,), generator=g)
        yield tokens, labels


def _twin_loss(kind, logits, labels, count):
    """The model's own loss from its logits with an extended ``CrossEntropyLoss``: for the
    LM, as transformers computes it (in float32, the labels shifted and padded with -100;
    a "sum" over ``count`` where the Trainer passes ``num_items_in_batch``)."""
    if kind != "GPT2LMHeadModel":
        return curvopt.extend(nn.CrossEntropyLoss())(logits, labels)
    shifted = F.pad(labels, (0, 1), value=-100)[:, 1:].flatten()
    if count is None:
        return curvopt.extend(nn.CrossEntropyLoss())(logits.float().flatten(0, 1), shifted)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction="sum"))
    return lossfunc(logits.float().flatten(0, 1), shifted) / count


def _hf_steps(kind, name, own_loss, count, micro=1):
    """Two optimizer steps, each of ``micro`` micro-batches (backward passes)."""
    model = _gpt2(kind)
    opt = HF_OPTIMIZERS[name](model.parameters())
    torch.manual_seed(5)  # the Monte-Carlo draws
    for batch, targets in _hf_batches(kind):
        opt.zero_grad()
        items = None if count is None else torch.tensor(count)
        for tokens, labels in zip(batch.chunk(micro), targets.chunk(micro)):
            if own_loss:
                loss = model(input_ids=tokens, labels=labels, num_items_in_batch=items).loss
            else:
                loss = _twin_loss(kind, model(input_ids=tokens).logits, labels, items)
            loss.backward()
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


@pytest.mark.parametrize("name", sorted(HF_OPTIMIZERS))
@pytest.mark.parametrize(
    "kind, count, micro",
    [
        ("GPT2LMHeadModel", None, 1),
        ("GPT2LMHeadModel", 20, 1),
        ("GPT2LMHeadModel", 20, 2),
        ("GPT2ForSequenceClassification", None, 1),
        ("GPT2ForSequenceClassification", None, 2),
    ],
)
def test_hugging_face_labels_loss_equals_an_extended_twin(kind, count, micro, name):
    """Two optimizer steps (of 1 or 2 micro-batches); the LM's loss is computed in float32 by
    transformers (its logits cast with ``.float()``), so the twin's is too, and the two agree
    to float32 roundoff (the loss is read from the float32 log-probabilities)."""
    got = _hf_steps(kind, name, True, count, micro)
    want = _hf_steps(kind, name, False, count, micro)
    start = torch.cat([p.detach().reshape(-1) for p in _gpt2(kind).parameters()])
    assert not torch.equal(want, start)
    tolerance = 1e-12 if kind == "GPT2ForSequenceClassification" else 1e-7
    assert float((got - want).abs().max() / want.abs().max()) <= tolerance
