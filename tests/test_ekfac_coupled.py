"""``EKFAC`` with BatchNorm in training mode (a coupled pass, ``engine.curvature``): the bases
from KFAC's Monte-Carlo factors, ``S = Σ_k (Q_0ᵀ Ĝ_k Q_1)²`` from the batch gradients ``ĝ_k`` of
the sampled columns (``engine.reducer``), checked in expectation against ``diag(Qᵀ G Q)``, ``G``
the GGN of the whole-batch function by ``torch.func`` (``test_batchnorm_expectation``'s
problems and reference), for bases ``Q`` held fixed (supplied: those of a first pass's fresh
factors), float64, within ``SIGMAS`` standard errors measured from ``PASSES`` passes of ``MC``
columns each. A pass with fresh bases gives the ``S`` of those bases from its own columns.
"""

from __future__ import annotations

import pytest
import torch
from test_batchnorm_expectation import CASES, MC, PASSES, _problem, _pure, _reference, _within

import curvopt
from curvopt import extensions as ext


def _expected(G, index, name, bases):
    """``diag(Qᵀ G_pp Q)`` as a ``[dim Q_0, ·]`` matrix, ``Q = Q_0 ⊗ Q_1`` (``Q_0`` for a
    one-dimensional parameter), ``G_pp`` the block of ``vec p`` (row-major, as ``as_rows``)."""
    block = G[index[name], index[name]]
    Q = torch.kron(*(q.contiguous() for q in bases)) if len(bases) == 2 else bases[0]
    return torch.diagonal(Q.T @ block @ Q).reshape(bases[0].shape[0], -1)


def _passes(model, X, y, lossfunc):
    """The fresh ``[S, *bases]`` of a first pass, then ``S`` of ``PASSES`` passes in its
    bases (supplied), each pass with its own seed."""
    ext_model, ext_loss = curvopt.extend(model), curvopt.extend(lossfunc)
    params = dict(ext_model.named_parameters())

    def one(seed, **options):
        ext_model.zero_grad()
        loss = ext_loss(ext_model(X), y)
        torch.manual_seed(seed)
        with curvopt.collect(ext.EKFAC(mc_samples=MC, **options)):
            loss.backward()
        return {k: [t.clone() for t in p.ekfac] for k, p in params.items()}

    fresh = one(999)
    bases = {p: fresh[k][1:] for k, p in params.items()}
    return fresh, [one(1000 + seed, bases=bases) for seed in range(PASSES)]


@pytest.mark.parametrize("kind,loss,reduction", CASES)
def test_ekfac_correction_is_unbiased_for_the_ggn_in_the_basis(kind, loss, reduction):
    model, X, y, lossfunc, layer, before, after = _problem(kind, loss, reduction)
    G, index, *_ = _reference(_pure(model), X, y, lossfunc, layer, before, after)
    model.train()
    fresh, passes = _passes(model, X, y, lossfunc)
    exact = {name: _expected(G, index, name, bases) for name, (_, *bases) in fresh.items()}
    scale = max(float(e.max()) for e in exact.values())  # the largest eigenvalue of a block
    errors = {}
    for name, (_, *bases) in fresh.items():
        assert all(torch.equal(q, p[name][i + 1]) for p in passes for i, q in enumerate(bases))
        samples = torch.stack([p[name][0] for p in passes])
        errors[name] = _within(samples, exact[name], f"EKFAC S of {name} vs diag(QᵀGQ)", scale)
    # power: 5 standard errors stay below 25% of the largest entry (measured: at most 2.9%, the
    # worst gap 3.9 standard errors; one column's relative standard deviation about 1.4 to 1.5
    # at the median entry above 1e-3 of the largest)
    assert max(errors.values()) < 0.05, errors


def test_fresh_bases_give_the_correction_of_their_own_columns():
    """A pass with fresh bases and one with those bases supplied, on the same draw, give the
    same ``S``; a one-dimensional parameter's ``S`` is the spectrum of its ``kfac`` block
    (both from the same columns: ``Σ_k (Qᵀ ĝ_k)²`` with ``Q`` the eigenvectors of
    ``Σ_k ĝ_k ĝ_kᵀ``)."""
    model, X, y, lossfunc, *_ = _problem("cnn", "ce", "mean")
    model = curvopt.extend(model.train())
    lossfunc = curvopt.extend(lossfunc)

    def run(*extensions):
        model.zero_grad()
        loss = lossfunc(model(X), y)
        torch.manual_seed(3)
        with curvopt.collect(*extensions):
            loss.backward()
        return {k: [t.clone() for t in p.ekfac] for k, p in model.named_parameters()}

    kfac = {}
    fresh = run(ext.EKFAC(mc_samples=4), ext.KFAC(mc_samples=4))
    for name, p in model.named_parameters():
        kfac[name] = [f.clone() for f in p.kfac]
    bases = {p: fresh[k][1:] for k, p in model.named_parameters()}
    supplied = run(ext.EKFAC(mc_samples=4, bases=bases))
    for name, (S, *bases) in fresh.items():
        torch.testing.assert_close(supplied[name][0], S, rtol=1e-12, atol=1e-14 * S.abs().max())
        if len(bases) == 1:
            Q = bases[0]
            torch.testing.assert_close(Q @ torch.diag(S[:, 0]) @ Q.T, kfac[name][0])
