"""``nn.LSTM``/``nn.GRU``/``nn.RNN`` against per-sample re-runs of the plain model (loops over
samples with their own parameter copies) and the exact GGN from ``torch.func``."""

from __future__ import annotations

import copy

import pytest
import torch
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

CLASSES = [nn.LSTM, nn.GRU, nn.RNN]


class Net(nn.Module):
    """Recurrent layer + linear head, reading ``output``, ``h_n`` or both."""

    def __init__(self, cls, batch_first, read="output", hx=False, **kw):
        super().__init__()
        self.rnn = cls(3, 4, batch_first=batch_first, **kw)
        dirs = 2 if kw.get("bidirectional") else 1
        self.head = nn.Linear(4 * dirs, 2)
        self.read, self.hx, self.batch_first = read, hx, batch_first

    def forward(self, x, h0=None):
        args = (x,) if h0 is None else (x, (h0, torch.tanh(h0)) if self.rnn.mode == "LSTM" else h0)
        out, state = self.rnn(*args)
        last = out[:, -1] if self.batch_first else out[-1]
        if self.read == "output":
            return self.head(last)
        h = state[0] if isinstance(state, tuple) else state  # [layers * dirs, N, H]
        dirs = 2 if self.rnn.bidirectional else 1
        top = torch.cat(list(h[-dirs:]), -1)
        if self.read == "h_n":
            return self.head(top)
        return self.head(top) + self.head(last)


def _data(batch_first, n=4, t=5):
    x = torch.randn(n, t, 3, dtype=DT) if batch_first else torch.randn(t, n, 3, dtype=DT)
    return x, torch.randint(0, 2, (n,))


CASES = [
    (cls, bf, read, kw)
    for cls in CLASSES
    for bf in (True, False)
    for read in ("output", "h_n", "both")
    for kw in ({}, {"num_layers": 2, "bidirectional": True})
]


def _id(case):
    cls, bf, read, kw = case
    return f"{cls.__name__}-{'bf' if bf else 'tf'}-{read}-{'deep' if kw else 'one'}"


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_first_order(case):
    cls, bf, read, kw = case
    torch.manual_seed(0)
    plain = Net(cls, bf, read, **kw).to(DT)
    x, y = _data(bf)
    check_against_loop(plain, nn.CrossEntropyLoss(), x, y, in_dim=0 if bf else 1)


@pytest.mark.parametrize("cls", CLASSES)
@pytest.mark.parametrize("bf", [True, False])
def test_first_order_with_initial_state(cls, bf):
    """``h0`` per sample (batch along dim 1 whatever ``batch_first``); sum reduction."""
    torch.manual_seed(0)
    plain = Net(cls, bf, "both", num_layers=2).to(DT)
    x, y = _data(bf, n=3)
    h0 = torch.randn(2, 3, 4, dtype=DT)
    check_against_loop(
        plain, nn.CrossEntropyLoss(reduction="sum"), (x, h0), y, in_dim=(0 if bf else 1, 1)
    )


@pytest.mark.parametrize("case", [c for c in CASES if c[2] != "output"][::2], ids=_id)
def test_ggn_diagonals(case):
    cls, bf, read, kw = case
    torch.manual_seed(0)
    plain = Net(cls, bf, read, **kw).to(DT)
    x, y = _data(bf, n=3)
    blocks, per_sample = ggn_reference(plain, nn.CrossEntropyLoss(), x, y)
    model = extended_copy(plain)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    with curvopt.collect(ext.DiagGGNExact(), ext.BatchDiagGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        assert_close(p.diag_ggn_exact, torch.diagonal(blocks[name]).reshape(p.shape), name)
        assert_close(p.diag_ggn_exact_batch, per_sample[name], name)


def test_ggn_mc_is_unbiased_in_the_mean():
    """The mean of many Monte-Carlo diagonals approaches the exact one."""
    torch.manual_seed(0)
    model = curvopt.extend(Net(nn.LSTM, True, "both").to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data(True, n=3)
    with curvopt.collect(ext.DiagGGNExact()):
        lossfunc(model(x), y).backward()
    exact = {k: p.diag_ggn_exact.clone() for k, p in model.named_parameters()}
    with curvopt.collect(ext.DiagGGNMC(mc_samples=4000)):
        lossfunc(model(x), y).backward()
    for name, p in model.named_parameters():
        scale = exact[name].abs().max()
        assert (p.diag_ggn_mc - exact[name]).abs().max() < 0.1 * scale, name


def test_diag_hessian_is_right_or_raises():
    torch.manual_seed(0)
    plain = Net(nn.GRU, True, "output").to(DT)
    x, y = _data(True, n=2)
    model = extended_copy(plain)
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    try:
        with curvopt.collect(ext.DiagHessian()):
            lossfunc(model(x), y).backward()
    except curvopt.errors.UnsupportedModuleError:
        assert not hasattr(model.rnn.weight_hh_l0, "diag_h")
        return
    diag, _ = hessian_reference(plain, nn.CrossEntropyLoss(), x, y)
    for name, p in model.named_parameters():
        assert_close(p.diag_h, diag[name], name)


def test_kronecker_raises_or_is_skipped():
    torch.manual_seed(0)
    model = curvopt.extend(Net(nn.LSTM, True).to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data(True)
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="recurrent.*skip_unsupported"):
        with curvopt.collect(ext.KFLR()):
            lossfunc(model(x), y).backward()
    with pytest.warns(UserWarning, match="rnn.weight_ih_l0"):
        with curvopt.collect(ext.KFLR(), skip_unsupported="diagonal") as ctx:
            lossfunc(model(x), y).backward()
    assert set(ctx.skipped) == {n for n, _ in model.rnn.named_parameters(prefix="rnn")}
    assert len(model.head.weight.kflr) == 2
    with curvopt.collect(ext.DiagGGNExact()):
        lossfunc(model(x), y).backward()
    for name, p in model.rnn.named_parameters():
        assert_close(p.kflr_diagonal, p.diag_ggn_exact, name)


def test_optim_kfac_with_fallback_trains_an_lstm():
    torch.manual_seed(0)
    model = curvopt.extend(Net(nn.LSTM, True, "both").to(DT))
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    x, y = _data(True, n=16)
    opt = curvopt.optim.KFAC(
        model.parameters(), lr=0.2, damping=0.1, fallback="diagonal", kl_clip=None
    )
    losses = []
    for step in range(30):
        opt.zero_grad()
        loss = lossfunc(model(x), y)
        with opt.collect():
            loss.backward()
        if step == 0:
            with pytest.warns(UserWarning):  # announced once, at the first step
                opt.step()
        else:
            opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize(
    "kw, match",
    [
        ({"proj_size": 2}, "proj_size"),
        ({"num_layers": 2, "dropout": 0.5}, "dropout"),
    ],
)
def test_unsupported_configurations_raise(kw, match):
    rnn = nn.LSTM(3, 4, batch_first=True, **kw).to(DT)
    model = curvopt.extend(nn.Sequential(rnn))
    out = model(torch.randn(2, 5, 3, dtype=DT))[0]
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match=match):
        with curvopt.collect(ext.BatchGrad()):
            out.sum().backward()


def test_packed_sequence_raises():
    rnn = curvopt.extend(nn.GRU(3, 4, batch_first=True).to(DT))
    packed = nn.utils.rnn.pack_padded_sequence(
        torch.randn(2, 5, 3, dtype=DT), torch.tensor([5, 3]), batch_first=True
    )
    out = rnn(packed)[1]
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="packed"):
        with curvopt.collect(ext.BatchGrad()):
            out.sum().backward()


def test_outside_collect_nothing_changes():
    torch.manual_seed(0)
    plain = Net(nn.LSTM, True, "both").to(DT)
    model = curvopt.extend(copy.deepcopy(plain))
    x, _ = _data(True)
    torch.testing.assert_close(model(x), plain(x), rtol=0, atol=0)
