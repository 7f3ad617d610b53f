"""``curvopt.linalg`` against dense float64 references built with ``torch.func`` on a flat θ.

The references differentiate ``θ ↦ lossfunc(model(X), y)`` on all data concatenated (so
"mean" batches are weighted as one batch): ``G = Jᵀ ∇²_f L J`` (``jacrev`` and the loss
Hessian), ``H = torch.func.hessian``, the empirical Fisher from per-sample gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, hessian, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

import curvopt
from curvopt import extensions as ext
from curvopt import linalg
from curvopt.errors import MissingLossError, UnsupportedLossError, UnsupportedModuleError
from fixtures import zoo

DT = torch.float64
pytestmark = pytest.mark.filterwarnings(
    "ignore:`torch.jit.script` is deprecated:DeprecationWarning"
)


class Residual(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp, self.block, self.out = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        return self.out(h + torch.sigmoid(self.block(h)))


class TinyTransformer(nn.Module):
    """Tokens ``[N, T]`` -> logits ``[N, V, T]`` (CrossEntropyLoss's K-dim layout)."""

    def __init__(self, vocab=5, dim=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layer = nn.TransformerEncoderLayer(dim, 2, 6, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        return self.head(self.layer(self.embed(tokens))).transpose(1, 2)


class TokenRows(nn.Module):
    """The zoo's GPT-style decoder with its logits flattened into loss rows ``[N T, V]``."""

    def __init__(self):
        super().__init__()
        self.gpt = zoo.gpt().model

    def forward(self, tokens):
        return self.gpt(tokens).flatten(0, 1)


def mlp():
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


def cnn():
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.Sigmoid(), nn.Flatten(), nn.Linear(2 * 4 * 4, 3)
    )


def _images(n, gen):
    return torch.randn(n, 1, 4, 4, generator=gen, dtype=DT)


def _vectors(n, gen):
    return torch.randn(n, 4, generator=gen, dtype=DT)


CASES = {
    "mlp": (mlp, _vectors, 3),
    "cnn": (cnn, _images, 3),
    "residual": (Residual, _vectors, 3),
}


def problem(name, reduction="mean", sizes=(3, 2), seed=0):
    """``(model, lossfunc, data)``: extended model, cross-entropy, batches of ``sizes``."""
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed)
    if name == "gpt":
        model = TokenRows()
        # the zoo ignores one target per batch; "mean" weights batches by rows, the
        # concatenated reference by kept rows: equal only without ignored targets
        batches = [zoo.gpt().make_batch(n, seed + i) for i, n in enumerate(sizes)]
        data = [
            (x, y.flatten().clamp(min=0) if len(sizes) > 1 else y.flatten()) for x, y in batches
        ]
    elif name == "transformer":
        model = TinyTransformer().to(DT).eval()
        data = [
            (torch.randint(0, 5, (n, 3), generator=gen), torch.randint(0, 5, (n, 3), generator=gen))
            for n in sizes
        ]
    else:
        build, inputs, classes = CASES[name]
        model = build().to(DT)
        data = [(inputs(n, gen), torch.randint(0, classes, (n,), generator=gen)) for n in sizes]
    lossfunc = curvopt.extend(nn.CrossEntropyLoss(reduction=reduction))
    return curvopt.extend(model), lossfunc, data


def _flat(model):
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = [p.detach() for p in model.parameters() if p.requires_grad]
    theta = torch.cat([p.flatten() for p in params])

    def forward(theta, inputs):
        pieces = theta.split([p.numel() for p in params])
        values = {n: t.view_as(p) for n, t, p in zip(names, pieces, params)}
        return functional_call(model, values, (inputs,))

    return theta, forward


def _joined(data):
    return torch.cat([x for x, _ in data]), torch.cat([y for _, y in data])


def dense_ggn(model, lossfunc, data):
    theta, forward = _flat(model)
    X, y = _joined(data)
    jac = jacrev(forward)(theta, X).flatten(0, -2)  # [F, P]
    out = forward(theta, X)
    hess = hessian(lambda o: lossfunc(o, y))(out).reshape(out.numel(), out.numel())
    return jac.T @ hess @ jac


def dense_hessian(model, lossfunc, data):
    """Row by row with plain autograd (``torch.func.hessian`` returns an asymmetric, wrong
    matrix for ``TransformerEncoderLayer``'s LayerNorm under ``vmap``; checked by finite
    differences)."""
    theta, forward = _flat(model)
    X, y = _joined(data)
    return torch.autograd.functional.hessian(lambda t: lossfunc(forward(t, X), y), theta)


def dense_ef(model, lossfunc, data):
    """``(1/N) Σ ∇ℓ_n ∇ℓ_nᵀ`` ("mean") or ``Σ ∇ℓ_n ∇ℓ_nᵀ`` ("sum"), ``ℓ_n`` the loss of sample
    ``n`` alone (mean over its positions for sequences)."""
    theta, forward = _flat(model)
    X, y = _joined(data)
    single = nn.CrossEntropyLoss(reduction=lossfunc.reduction)
    grads = torch.stack(
        [
            grad(lambda t, x=x, target=target: single(forward(t, x), target))(theta)
            for x, target in zip(X[:, None], y[:, None])
        ]
    )
    return grads.T @ grads / (len(X) if lossfunc.reduction == "mean" else 1)


def assert_matrix(actual, expected, rtol=1e-9):
    expected = expected.detach().numpy() if isinstance(expected, torch.Tensor) else expected
    scale = max(np.abs(expected).max(), 1e-12)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=rtol * scale)


@pytest.fixture(autouse=True)
def _math_attention():
    """Attention's fused CPU kernels have no double backward; the references need one."""
    with sdpa_kernel(SDPBackend.MATH):
        yield


@pytest.mark.parametrize("name", ["mlp", "cnn", "residual", "transformer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_ggn_and_hessian_match_dense(name, reduction):
    model, lossfunc, data = problem(name, reduction)
    assert_matrix(linalg.GGN(model, lossfunc, data).to_dense(), dense_ggn(model, lossfunc, data))
    assert_matrix(
        linalg.Hessian(model, lossfunc, data).to_dense(), dense_hessian(model, lossfunc, data)
    )


@pytest.mark.parametrize("sizes", [(2, 1), (3,)])
def test_ggn_of_the_zoo_gpt(sizes):
    """Tied embedding and head, causal attention, LayerNorms; one batch with ignored targets."""
    model, lossfunc, data = problem("gpt", sizes=sizes)
    assert (data[0][1] == -100).any() == (len(sizes) == 1)
    assert_matrix(linalg.GGN(model, lossfunc, data).to_dense(), dense_ggn(model, lossfunc, data))


@pytest.mark.parametrize("name", ["mlp", "transformer"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_empirical_fisher_matches_per_sample_gradients(name, reduction):
    model, lossfunc, data = problem(name, reduction)
    actual = linalg.EmpiricalFisher(model, lossfunc, data).to_dense()
    assert_matrix(actual, dense_ef(model, lossfunc, data))


def test_fisher_mc_is_fixed_by_seed_and_unbiased_for_ggn():
    model, lossfunc, data = problem("mlp", sizes=(2, 1))
    state = torch.random.get_rng_state()
    first = linalg.FisherMC(model, lossfunc, data, mc_samples=2, seed=3).to_dense()
    assert torch.equal(state, torch.random.get_rng_state())
    np.testing.assert_array_equal(
        first, linalg.FisherMC(model, lossfunc, data, mc_samples=2, seed=3).to_dense()
    )
    assert np.linalg.eigvalsh(first).min() > -1e-12
    many = linalg.FisherMC(model, lossfunc, data, mc_samples=20_000, seed=0).to_dense()
    expected = dense_ggn(model, lossfunc, data).numpy()
    error = np.linalg.norm(many - expected) / np.linalg.norm(expected)
    assert error < 0.03, error
    assert np.linalg.norm(first - expected) / np.linalg.norm(expected) > 0.05  # really sampled


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_mse_fisher_is_the_empirical_fisher_expected_under_the_loss_gaussian(reduction):
    """``MSELoss`` on ``K = 3`` outputs: the loss of one sample is the negative log-likelihood
    of ``N(f, σ² I)`` up to a constant, ``ℓ_n = ‖f − y‖² / K`` (``σ² = K/2``) for ``"mean"`` and
    ``‖f − y‖²`` (``σ² = 1/2``) for ``"sum"``. ``EmpiricalFisher`` at targets drawn from it
    has the expectation ``G`` (exactly: the ``2K`` targets ``f ± σ √K e_k`` of equal weight
    have the Gaussian's second moments, and ``EF`` is quadratic in ``f − y`` sample by
    sample), and ``FisherMC``, which draws them, is unbiased for ``G``."""
    gen = torch.Generator().manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    lossfunc = curvopt.extend(nn.MSELoss(reduction=reduction))
    X = torch.randn(5, 2, generator=gen, dtype=DT)
    data = [(X, torch.randn(5, 3, generator=gen, dtype=DT))]
    ggn = dense_ggn(model, lossfunc, data)
    with torch.no_grad():
        f = model(X)
    outputs = f.shape[1]
    spread = (outputs / 2 if reduction == "mean" else 0.5) ** 0.5 * outputs**0.5
    expected_ef = np.mean(
        [
            linalg.EmpiricalFisher(model, lossfunc, [(X, f + sign * spread * e)]).to_dense()
            for e in torch.eye(outputs, dtype=DT)
            for sign in (1, -1)
        ],
        axis=0,
    )
    assert_matrix(expected_ef, ggn)
    ef = linalg.EmpiricalFisher(model, lossfunc, data).to_dense()
    assert np.linalg.norm(ef - ggn.numpy()) > 0.1 * np.linalg.norm(ggn.numpy())  # a real check
    many = linalg.FisherMC(model, lossfunc, data, mc_samples=20_000, seed=0).to_dense()
    error = np.linalg.norm(many - ggn.numpy()) / np.linalg.norm(ggn.numpy())
    assert error < 0.03, error


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_bce_fisher_is_the_ggn_and_the_empirical_fisher_expected_is_its_kth(reduction):
    """``BCEWithLogitsLoss`` on ``K = 3`` outputs: ``FisherMC`` is unbiased for ``G``;
    ``EmpiricalFisher``'s expectation at targets drawn from Bernoulli(``σ(f)``) (exactly: the
    ``2^K`` targets of each sample weighted by their probabilities) is ``G/K`` for ``"mean"``,
    whose sample loss is ``1/K`` times the log-likelihood, and ``G`` for ``"sum"``."""
    gen = torch.Generator().manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(2, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT))
    lossfunc = curvopt.extend(nn.BCEWithLogitsLoss(reduction=reduction))
    X = torch.randn(4, 2, generator=gen, dtype=DT)
    data = [(X, torch.randint(0, 2, (4, 3), generator=gen).to(DT))]
    ggn = dense_ggn(model, lossfunc, data).numpy()
    with torch.no_grad():
        p = torch.sigmoid(model(X))
    targets = torch.cartesian_prod(*[torch.tensor([0.0, 1.0], dtype=DT)] * p.shape[1])
    expected_ef = sum(
        float(torch.where(t == 1, p[n], 1 - p[n]).prod())
        * linalg.EmpiricalFisher(model, lossfunc, [(X[n : n + 1], t[None])]).to_dense()
        for n in range(len(X))
        for t in targets
    ) / (len(X) if reduction == "mean" else 1)
    assert_matrix(expected_ef, ggn / (p.shape[1] if reduction == "mean" else 1))
    many = linalg.FisherMC(model, lossfunc, data, mc_samples=20_000, seed=0).to_dense()
    assert np.linalg.norm(many - ggn) / np.linalg.norm(ggn) < 0.03


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_diagonals_match_dense_diagonals(reduction):
    model, lossfunc, data = problem("mlp", reduction)
    ggn, hess = dense_ggn(model, lossfunc, data), dense_hessian(model, lossfunc, data)
    for curvature, dense in (("ggn_exact", ggn), ("hessian", hess)):
        diag = linalg.Diagonal(model, lossfunc, data, curvature=curvature)
        assert_matrix(diag.to_dense(), torch.diag(torch.diagonal(dense)))
    mc = linalg.Diagonal(model, lossfunc, data, curvature="ggn_mc", mc_samples=5000).diagonal
    assert torch.allclose(mc, torch.diagonal(ggn), rtol=0.1, atol=0.02 * ggn.diagonal().max())


def _collected(model, lossfunc, batch, extension):
    X, y = batch
    with curvopt.collect(extension):
        lossfunc(model(X), y).backward()
    values = [getattr(p, extension.attr) for p in model.parameters()]
    for p in model.parameters():
        p.grad = None
        delattr(p, extension.attr)
    return values


@pytest.mark.parametrize("name", ["mlp", "cnn"])
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_kfac_blocks_are_the_collected_factors_weighted_over_batches(name, reduction):
    model, lossfunc, data = problem(name, reduction)
    per_batch = [_collected(model, lossfunc, batch, ext.KFLR()) for batch in data]
    sizes = [len(x) for x, _ in data]
    total = sum(sizes)
    out_w = [n / total for n in sizes] if reduction == "mean" else [1.0] * len(sizes)
    blocks = []
    for i in range(len(per_batch[0])):
        factors = [b[i] for b in per_batch]
        B = sum(w * f[0] for w, f in zip(out_w, factors))
        if len(factors[0]) == 1:
            blocks.append(B)
        else:
            A = sum(n / total * f[1] for n, f in zip(sizes, factors))
            blocks.append(torch.kron(B, A))
    K = linalg.KFAC(model, lossfunc, data, curvature="kflr")
    assert_matrix(K.to_dense(), torch.block_diag(*blocks))
    one = linalg.KFAC(model, lossfunc, data[:1], curvature="kflr")
    assert_matrix(
        one.to_dense(),
        torch.block_diag(*[torch.kron(*f) if len(f) == 2 else f[0] for f in per_batch[0]]),
    )


@pytest.mark.parametrize(
    "loss",
    [
        nn.CrossEntropyLoss(ignore_index=-1),
        nn.CrossEntropyLoss(weight=torch.tensor([0.3, 1.0, 2.0], dtype=DT)),
        nn.CrossEntropyLoss(weight=torch.tensor([0.3, 1.0, 2.0], dtype=DT), ignore_index=-1),
    ],
    ids=["ignore_index", "class_weights", "both"],
)
def test_batches_weigh_by_their_loss_divisor_as_one_batch(loss):
    """Per-pixel cross-entropy ``[N, C, H, W]`` over two batches whose shares of counted
    targets (or of class weight) differ: the operators are those of the loss on the data as one
    batch (each batch weighted by its loss's divisor ``D_b``, not by its size)."""
    gen = torch.Generator().manual_seed(0)
    model = curvopt.extend(
        nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 3, 1)).to(DT)
    )
    lossfunc = curvopt.extend(loss)
    images = [torch.randn(n, 2, 3, 3, generator=gen, dtype=DT) for n in (2, 3)]
    data = [(x, torch.randint(0, 3, (len(x), 3, 3), generator=gen)) for x in images]
    dropped = -1 if loss.ignore_index == -1 else 0  # ignored, or the lightest class
    data[0][1][0, :2] = dropped
    data[0][1][1, 0, 0] = dropped
    one = [_joined(data)]
    ggn, hess = dense_ggn(model, lossfunc, data), dense_hessian(model, lossfunc, data)
    assert_matrix(linalg.GGN(model, lossfunc, data).to_dense(), ggn)
    assert_matrix(linalg.Hessian(model, lossfunc, data).to_dense(), hess)
    for curvature, dense in (("ggn_exact", ggn), ("hessian", hess)):
        diag = linalg.Diagonal(model, lossfunc, data, curvature=curvature)
        assert_matrix(diag.to_dense(), torch.diag(torch.diagonal(dense)))
    for operator in (linalg.KFAC, linalg.EKFAC):
        expected = operator(model, lossfunc, one, curvature="kflr").to_dense()
        assert_matrix(operator(model, lossfunc, data, curvature="kflr").to_dense(), expected)


def test_kflr_of_one_sample_is_the_exact_ggn_block():
    model, lossfunc, data = problem("mlp", sizes=(1,))
    ggn = dense_ggn(model, lossfunc, data)
    sizes = [p.numel() for p in model.parameters()]
    mask = torch.block_diag(*[torch.ones(s, s, dtype=DT) for s in sizes])
    assert_matrix(linalg.KFAC(model, lossfunc, data, curvature="kflr").to_dense(), ggn * mask)


def _optimizer_step(opt_cls, model, lossfunc, batch, **kwargs):
    """The update ``θ_new − θ_old`` of one paper step of ``opt_cls(lr=1, kl_clip=None)`` (no
    trust region; restores ``θ``)."""
    before = [p.detach().clone() for p in model.parameters()]
    opt = opt_cls(model.parameters(), lr=1.0, kl_clip=None, **kwargs)
    X, y = batch
    loss = lossfunc(model(X), y)
    with opt.collect():
        loss.backward()
    gradient = torch.cat([p.grad.flatten() for p in model.parameters()])
    opt.step()
    step = torch.cat([(p.detach() - b).flatten() for p, b in zip(model.parameters(), before)])
    with torch.no_grad():
        for p, b in zip(model.parameters(), before):
            p.copy_(b)
            p.grad = None
    return gradient.numpy(), step.numpy()


@pytest.mark.parametrize("kronecker_damping", ["trace_norm", "exact"])
def test_kfac_inverse_is_the_optimizer_step(kronecker_damping):
    model, lossfunc, data = problem("cnn", sizes=(4,))
    gradient, step = _optimizer_step(
        curvopt.optim.KFAC,
        model,
        lossfunc,
        data[0],
        damping=0.1,
        curvature="kflr",
        kronecker_damping=kronecker_damping,
    )
    K = linalg.KFAC(model, lossfunc, data, curvature="kflr")
    np.testing.assert_allclose(K.inverse(0.1, kronecker_damping) @ gradient, -step, atol=1e-10)


def test_diagonal_inverse_is_the_optimizer_step():
    model, lossfunc, data = problem("mlp", sizes=(4,))
    gradient, step = _optimizer_step(
        curvopt.optim.DiagGGNNewton, model, lossfunc, data[0], damping=0.1, curvature="exact"
    )
    D = linalg.Diagonal(model, lossfunc, data, curvature="ggn_exact")
    np.testing.assert_allclose(D.inverse(0.1) @ gradient, -step, atol=1e-10)


def test_operators_leave_parameters_grads_and_attributes_alone():
    model, lossfunc, data = problem("mlp")
    for p in model.parameters():
        p.grad = torch.ones_like(p)
        p.kflr = "mine"
    before = [p.detach().clone() for p in model.parameters()]
    vector = np.ones(sum(p.numel() for p in model.parameters()))
    for op in (
        linalg.GGN(model, lossfunc, data),
        linalg.Hessian(model, lossfunc, data),
        linalg.EmpiricalFisher(model, lossfunc, data),
        linalg.FisherMC(model, lossfunc, data),
        linalg.Diagonal(model, lossfunc, data, curvature="hessian"),
        linalg.KFAC(model, lossfunc, data, curvature="kflr"),
    ):
        assert op.shape == (len(vector), len(vector)) and op.dtype == np.float64
        assert np.isfinite(op @ vector).all() and (
            op.matmat(vector[:, None]).shape == (len(vector), 1)
        )
    for p, b in zip(model.parameters(), before):
        assert torch.equal(p, b) and torch.equal(p.grad, torch.ones_like(p)) and p.kflr == "mine"
        assert not hasattr(p, "diag_h")


def test_model_dtype_is_kept():
    model, lossfunc, data = problem("mlp")
    model.float()
    op = linalg.GGN(model, lossfunc, data)
    assert op.dtype == np.float32 and (op @ np.ones(op.shape[0])).dtype == np.float32


def test_bad_input_raises_clear_errors():
    model, lossfunc, data = problem("mlp")
    with pytest.raises(ValueError, match="data is empty"):
        linalg.GGN(model, lossfunc, [])
    with pytest.raises(ValueError, match="curvopt.extend"):
        linalg.GGN(mlp().to(DT), lossfunc, data)
    with pytest.raises(MissingLossError, match="curvopt.extend"):
        linalg.Hessian(model, nn.CrossEntropyLoss(), data)
    with pytest.raises(UnsupportedLossError, match="reduction"):
        linalg.GGN(model, curvopt.extend(nn.CrossEntropyLoss(reduction="none")), data)
    with pytest.raises(ValueError, match="curvature"):
        linalg.KFAC(model, lossfunc, data, curvature="kfc")
    with pytest.raises(ValueError, match="kronecker_damping"):
        linalg.KFAC(model, lossfunc, data, curvature="kflr").inverse(1.0, "traces")
    normed = curvopt.extend(nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)).to(DT))
    with pytest.raises(UnsupportedModuleError, match="train mode"):
        linalg.EmpiricalFisher(normed, lossfunc, data)
    transposed = curvopt.extend(nn.Sequential(nn.ConvTranspose2d(2, 2, 1), nn.Flatten()).to(DT))
    images = [(torch.randn(2, 2, 1, 1, dtype=DT), torch.tensor([0, 1]))]
    with pytest.raises(UnsupportedModuleError, match="transposed"):
        linalg.KFAC(transposed, lossfunc, images, curvature="kflr")


def test_top_eigenpairs_and_hutchinson_estimates():
    model, lossfunc, data = problem("mlp")
    G = linalg.GGN(model, lossfunc, data)
    dense = dense_ggn(model, lossfunc, data).numpy()
    values, vectors = np.linalg.eigh(dense)
    top, top_vectors = linalg.top_eigenpairs(G, k=3)
    np.testing.assert_allclose(top, values[::-1][:3], rtol=1e-8)
    overlap = np.abs(np.sum(top_vectors * vectors[:, ::-1][:, :3], 0))
    np.testing.assert_allclose(overlap, 1.0, atol=1e-6)
    trace = linalg.hutchinson_trace(G, num_samples=200, seed=1)
    assert 0 < trace.std_error and abs(trace.value - np.trace(dense)) < 4 * trace.std_error
    diag = linalg.hutchinson_diagonal(G, num_samples=200, seed=1)
    assert (np.abs(diag.value - np.diag(dense)) <= 4 * diag.std_error + 1e-12).mean() > 0.9
    with pytest.raises(ValueError, match="k"):
        linalg.top_eigenpairs(G, k=G.shape[0])
