"""``curvopt.laplace`` against laplace-torch's own BackPACK and curvlinops backends, in float64,
on the models they support (an MLP and a CNN with a strided, padded conv; classification and
regression): ``full``, ``diag`` and ``kron``, the loss, a subnetwork and the last layer.

Known differences, by design, tested against the exact block instead: for a conv bias under
``kfac_approx="expand"`` curvlinops returns the weight's output factor (an approximation),
curvopt (and BackPACK) the bias's exact block; BackPACK's conv weight factors are another
approximation than curvlinops' (which curvopt's equal), so conv weights compare to curvlinops.
curvlinops' ``full`` multiplies by a float32 identity, so it agrees to ~1e-7 only.
"""

import copy

import pytest
import torch
from conftest import DT
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("laplace")
from laplace import Laplace  # noqa: E402
from laplace.curvature import (  # noqa: E402
    BackPackEF,
    BackPackGGN,
    CurvlinopsEF,
    CurvlinopsGGN,
    EFInterface,
    GGNInterface,
)

from curvopt.laplace import CurvoptEF, CurvoptGGN  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::UserWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def _cnn():
    return nn.Sequential(
        nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(27, 3)
    )


def _problem(arch, likelihood, n=6):
    torch.manual_seed(0)
    model = (_mlp() if arch == "mlp" else _cnn()).to(DT)
    model.output_size = 3  # what Laplace.fit sets, BackPACK's jacobians read
    x = torch.randn(n, 4, dtype=DT) if arch == "mlp" else torch.randn(n, 2, 6, 6, dtype=DT)
    y = torch.randint(0, 3, (n,)) if likelihood == "classification" else torch.randn(n, 3, dtype=DT)
    return model, x, y


def _backend(cls, model, likelihood, **kwargs):
    return cls(copy.deepcopy(model), likelihood, **kwargs)


def _close(got, want, rtol=1e-10):
    torch.testing.assert_close(got, want, rtol=rtol, atol=rtol * want.abs().max().item())


REFERENCES = {
    "ggn": (CurvoptGGN, BackPackGGN, CurvlinopsGGN),
    "ef": (CurvoptEF, BackPackEF, CurvlinopsEF),
}
CASES = [(a, lik) for a in ("mlp", "cnn") for lik in ("classification", "regression")]


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("arch,likelihood", CASES)
def test_full_and_diag(arch, likelihood, kind):
    model, x, y = _problem(arch, likelihood)
    mine, backpack, curvlinops = REFERENCES[kind]
    loss, full = _backend(mine, model, likelihood).full(x, y, N=10)
    ref_loss, ref_full = _backend(backpack, model, likelihood).full(x, y, N=10)
    _close(loss, ref_loss)
    _close(full, ref_full)
    _close(full, _backend(curvlinops, model, likelihood).full(x, y, N=10)[1], rtol=1e-6)
    loss, diag = _backend(mine, model, likelihood).diag(x, y, N=10)
    for reference in (backpack, curvlinops):
        ref_loss, ref_diag = _backend(reference, model, likelihood).diag(x, y, N=10)
        _close(loss, ref_loss)
        _close(diag, ref_diag)
    _close(diag, full.diagonal())


def _conv_bias(arch, index):
    return arch == "cnn" and index == 1


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("arch,likelihood", CASES)
def test_kron(arch, likelihood, kind):
    model, x, y = _problem(arch, likelihood)
    mine, backpack, curvlinops = REFERENCES[kind]
    loss, kron = _backend(mine, model, likelihood).kron(x, y, N=10)
    ref_loss, ref = _backend(curvlinops, model, likelihood).kron(x, y, N=10)
    _close(loss, ref_loss)
    exact = _backend(backpack, model, likelihood).full(x, y, N=10)[1]
    start = 0
    for index, (p, got, want) in enumerate(zip(model.parameters(), kron.kfacs, ref.kfacs)):
        assert [f.shape for f in got] == [f.shape for f in want]
        if _conv_bias(arch, index):  # the exact block, not curvlinops' approximation
            block = exact[start : start + p.numel(), start : start + p.numel()]
            _close(got[0], block)
        else:
            for g, w in zip(got, want):
                _close(g, w)
        start += p.numel()
    if kind == "ggn":  # BackPACK's KFLR: linear layers and biases
        ref = _backend(backpack, model, likelihood).kron(x, y, N=10)[1]
        for index, (got, want) in enumerate(zip(kron.kfacs, ref.kfacs)):
            if arch == "mlp" or index > 0:
                for g, w in zip(got, want):
                    _close(g, w)


@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_subnetwork(kind):
    model, x, y = _problem("cnn", "classification")
    indices = torch.tensor([0, 3, 7, 20, 50, 54, 55, 100, 131])
    mine, backpack, _ = REFERENCES[kind]
    got = _backend(mine, model, "classification", subnetwork_indices=indices)

    def want():  # BackPACK's jacobians un-extend the model: a fresh backend for each call
        return _backend(backpack, model, "classification", subnetwork_indices=indices)

    _close(got.full(x, y)[1], want().full(x, y)[1])
    _close(got.diag(x, y)[1], want().diag(x, y)[1])
    with pytest.raises(ValueError, match="subnetwork"):
        got.kron(x, y, N=6)
    la = Laplace(
        copy.deepcopy(model),
        "classification",
        subset_of_weights="subnetwork",
        hessian_structure="full",
        subnetwork_indices=indices,
        backend=mine,
    )
    la.fit(DataLoader(TensorDataset(x, y), batch_size=4))
    _close(la.H, want().full(x, y)[1])


@pytest.mark.parametrize("kind", ["ggn", "ef"])
@pytest.mark.parametrize("structure", ["full", "kron", "diag"])
@pytest.mark.parametrize("likelihood", ["classification", "regression"])
def test_last_layer_and_batches(structure, likelihood, kind):
    """``Laplace.fit`` over several batches (the kron factors' ``M / N``), all weights and the
    last layer, against the same fit with curvlinops' backend (BackPACK's for the EF diagonal:
    curvlinops' EF ``diag``, laplace's torch.func gradients, is zero for the last layer)."""
    model, x, y = _problem("cnn", likelihood, n=10)
    loader = DataLoader(TensorDataset(x, y), batch_size=4)
    mine, backpack, curvlinops = REFERENCES[kind]
    reference = backpack if (kind, structure) == ("ef", "diag") else curvlinops
    for subset in ("all", "last_layer"):
        fits = []
        for backend in (mine, reference):
            la = Laplace(
                copy.deepcopy(model),
                likelihood,
                subset_of_weights=subset,
                hessian_structure=structure,
                backend=backend,
            )
            la.fit(loader)
            fits.append(la)
        got, want = fits
        _close(got.loss, want.loss)
        if structure == "kron":
            skip = subset == "all"  # the conv bias: exact block against curvlinops' factor
            for index, (g, w) in enumerate(zip(got.H_facs.kfacs, want.H_facs.kfacs)):
                if not (skip and index == 1):
                    for a, b in zip(g, w):
                        _close(a, b)
        else:
            _close(got.H, want.H, rtol=1e-6 if structure == "full" else 1e-10)
        if not (structure == "kron" and subset == "all"):
            _close(got.log_marginal_likelihood(), want.log_marginal_likelihood(), rtol=1e-6)


def test_stochastic_is_unbiased():
    """``stochastic=True``: the Monte-Carlo Fisher's diagonal and output-side KFAC factor average
    to the exact ones (8 standard errors)."""
    model, x, y = _problem("mlp", "classification")
    exact = _backend(CurvoptGGN, model, "classification")
    mc = _backend(CurvoptGGN, model, "classification", stochastic=True, num_samples=4)
    torch.manual_seed(1)
    draws = torch.stack([mc.diag(x, y)[1] for _ in range(300)])
    diag = exact.diag(x, y)[1]
    err = (draws.mean(0) - diag).abs()
    assert (err <= 8 * draws.std(0) / 300**0.5 + 1e-12).all()
    kron = exact.kron(x, y, N=6)[1]
    draws = [mc.kron(x, y, N=6)[1] for _ in range(300)]
    for index in range(len(kron.kfacs)):
        stack = torch.stack([d.kfacs[index][0] for d in draws])
        err = (stack.mean(0) - kron.kfacs[index][0]).abs()
        assert (err <= 8 * stack.std(0) / 300**0.5 + 1e-12).all()
        if len(kron.kfacs[index]) == 2:  # the input side is exact
            _close(draws[0].kfacs[index][1], kron.kfacs[index][1])


def test_jacobians_and_gradients():
    model, x, y = _problem("cnn", "classification")
    mine = _backend(CurvoptGGN, model, "classification")
    ref = _backend(BackPackGGN, model, "classification")
    js, f = mine.jacobians(x)
    ref_js, ref_f = ref.jacobians(x)
    _close(js, ref_js)
    _close(f, ref_f)
    outputs = torch.tensor([[0, 2], [1, 1], [2, 0], [0, 0], [1, 2], [2, 2]])
    sel, _ = mine.selected_output_jacobians(x, outputs)
    _close(sel, torch.gather(ref_js, 1, outputs[..., None].expand(-1, -1, js.shape[-1])))
    gs, loss = _backend(CurvoptEF, model, "classification").gradients(x, y)
    ref_gs, ref_loss = _backend(BackPackEF, model, "classification").gradients(x, y)
    _close(gs, ref_gs)
    _close(loss, ref_loss.detach())
    for p in mine.params:  # nothing left behind
        assert p.grad is None and not hasattr(p, "grad_batch")


def test_bad_kfac_approx():
    with pytest.raises(ValueError, match="CurvoptGGN: kfac_approx"):
        CurvoptGGN(_mlp(), "classification", kfac_approx="both")


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = _mlp(), nn.Linear(3, 2)

    def forward(self, x):
        return self.used(x)


@pytest.mark.parametrize("kind", ["ggn", "ef"])
def test_unused_parameter_has_zero_curvature(kind):
    """A trainable parameter the output does not depend on: zero rows, as laplace's torch.func
    curvature has them, and zero Kronecker factors."""
    torch.manual_seed(0)
    model = _WithUnused().to(DT)
    x, y = torch.randn(6, 4, dtype=DT), torch.randint(0, 3, (6,))
    mine = CurvoptGGN if kind == "ggn" else CurvoptEF
    reference = GGNInterface if kind == "ggn" else EFInterface
    for structure in ("full", "diag"):
        got = getattr(_backend(mine, model, "classification"), structure)(x, y)[1]
        want = getattr(_backend(reference, model, "classification"), structure)(x, y)[1]
        _close(got, want)
    kron = _backend(mine, model, "classification").kron(x, y, N=6)[1]
    assert [f.shape for f in kron.kfacs[-2]] == [(2, 2), (3, 3)]
    assert all((f == 0).all() for factors in kron.kfacs[-2:] for f in factors)
    assert all(f.abs().sum() > 0 for factors in kron.kfacs[:-2] for f in factors)
