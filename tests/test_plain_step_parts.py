"""The parts of a plain step that keep or fuse work (float64 against independent references).

A plain step applies the inverses kept since the last refresh: ``EKFAC``'s rotations take the
bases' transposed views kept with the inverse (``rotate(..., transposed=...)``), the trust
region reads ``K ⊙ c ⊙ c`` of all parameters by foreach calls and scales the directions it owns
by one (``scaled_directions``), and the finite check decides on the host from one read of the
norms (``base._within_range``). Each is the work it replaces, bit for bit, and the quantity it
stands for: rotations and solves against dense Kronecker products, the trust region's
quadratic against ``vec(D)ᵀ (Q diag(vec K + λ) Qᵀ) vec(D)``, the check's verdict against the
per-tensor norms' rule.
"""

import math

import pytest
import torch
from conftest import free_earlier_optimizers
from torch import nn

import curvopt
from curvopt.inversion.inverses import EigenCorrectedInverse
from curvopt.layers.eigenbasis import rotate
from curvopt.optim import EKFAC
from curvopt.optim.base import _norms, _within_range
from curvopt.optim.plan import ParamUpdate
from curvopt.optim.stages import trust_region
from curvopt.optim.stages.base import ParamStep, scaled_directions

DT = torch.float64


@pytest.fixture(autouse=True)
def _no_other_optimizer():
    """Optimizers of earlier tests, in reference cycles, are freed: an awake one would collect."""
    free_earlier_optimizers()


def _orthogonal(n: int, generator, batch=()) -> torch.Tensor:
    return torch.linalg.qr(torch.randn(*batch, n, n, dtype=DT, generator=generator))[0]


@pytest.mark.parametrize("sides", [2, 1, 0])
@pytest.mark.parametrize("back", [False, True])
def test_rotation_with_kept_transposes_is_the_dense_kronecker_rotation(sides, back):
    """``Q_Bᵀ M Q_A`` (``back``: ``Q_B M Q_Aᵀ``) with the transposed views kept equals the one
    that forms them (bit for bit) and ``(Q_B ⊗ Q_A)ᵀ vec(M)`` (``Q_B ⊗ Q_A``) densely."""
    generator = torch.Generator().manual_seed(sides + 3 * back)
    bases = [_orthogonal(5, generator), _orthogonal(3, generator)][:sides]
    matrix = torch.randn(5 if sides else 1, 3 if sides == 2 else (1 if sides else 15), dtype=DT)
    kept = rotate(bases, matrix, back=back, transposed=[q.mT for q in bases])
    assert torch.equal(kept, rotate(bases, matrix, back=back))
    dense = torch.eye(1, dtype=DT)
    for q in bases:
        dense = torch.kron(dense, q)
    if not bases:
        dense = torch.eye(matrix.numel(), dtype=DT)
    elif sides == 1:
        dense = torch.kron(dense, torch.eye(matrix.shape[1], dtype=DT))
    expected = (dense if back else dense.T) @ matrix.reshape(-1)
    torch.testing.assert_close(kept.reshape(-1), expected, rtol=1e-12, atol=1e-14)


def test_rotation_of_stacked_bases_ignores_no_transposes():
    """Grouped bases ``[G, d, d]`` with matrices ``[G, d, k]``: the kept views change nothing."""
    generator = torch.Generator().manual_seed(0)
    bases = [_orthogonal(4, generator, (2,)), _orthogonal(3, generator, (2,))]
    matrix = torch.randn(2, 4, 3, dtype=DT, generator=generator)
    for back in (False, True):
        kept = rotate(bases, matrix, back=back, transposed=[q.mT for q in bases])
        assert torch.equal(kept, rotate(bases, matrix, back=back))
        expected = bases[0] @ matrix @ bases[1].mT if back else bases[0].mT @ matrix @ bases[1]
        torch.testing.assert_close(kept, expected, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shape", [(4, 3), (4,)])
def test_eigen_corrected_solve_applied_again_is_the_dense_solve(shape):
    """``EigenCorrectedInverse`` applied twice (its ``S + λ`` and transposed views formed at the
    first) gives the same bits, ``(Q diag(vec S) Qᵀ + λ I)⁻¹ vec(G)`` densely, and coordinates
    ``Qᵀ vec(G) / (vec S + λ)``."""
    generator = torch.Generator().manual_seed(len(shape))
    bases = [_orthogonal(4, generator), _orthogonal(3, generator)][: len(shape)]
    columns = shape[1] if len(shape) == 2 else 1
    correction = torch.rand(4, columns, dtype=DT, generator=generator) + 0.1
    inverse = EigenCorrectedInverse.build([correction, *bases], 0.05)
    grad = torch.randn(shape, dtype=DT, generator=generator)
    direction, coordinates = inverse.apply_with_coordinates(grad)
    again, again_coordinates = inverse.apply_with_coordinates(grad)
    assert torch.equal(direction, again) and torch.equal(coordinates, again_coordinates)
    assert direction.shape == grad.shape
    q = torch.kron(bases[0], bases[1]) if len(bases) == 2 else bases[0]
    dense = q @ torch.diag(correction.reshape(-1)) @ q.T + 0.05 * torch.eye(len(q), dtype=DT)
    expected = torch.linalg.solve(dense, grad.reshape(-1))
    torch.testing.assert_close(direction.reshape(-1), expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        coordinates.reshape(-1), q.T @ grad.reshape(-1) / (correction.reshape(-1) + 0.05)
    )


@pytest.mark.parametrize("dtype", [torch.float32, DT])
def test_scaled_directions_scale_the_owned_in_place_and_copy_the_others(dtype):
    """The owned directions scaled in place (the same tensors), the others into new tensors
    that the steps then own; every value that of ``mul_`` on its own, bit for bit."""
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(n, dtype=dtype, generator=generator) for n in (3, 5, 7)]
    items = [ParamStep(ParamUpdate(torch.zeros(1), f"p{i}"), g, {}) for i, g in enumerate(grads)]
    for item, g in zip(items, grads):
        item.direction = g * 1.5
    items[0].own, items[2].own = items[0].direction, items[2].direction  # items[1]: not owned
    before = [item.direction for item in items]
    expected = [d.clone().mul_(0.3) for d in before]
    values = [d.clone() for d in before]
    scaled = scaled_directions(items, 0.3)
    assert scaled[0] is before[0] and scaled[2] is before[2] and scaled[1] is not before[1]
    assert torch.equal(before[1], values[1])  # not owned: left as it was
    assert items[1].own is scaled[1]
    for got, want in zip(scaled, expected):
        assert torch.equal(got, want)


def _reference_verdict(checks, params, deltas) -> bool:
    """The rule of ``_within_range`` on per-tensor norms in float64."""
    norms = [float(torch.linalg.vector_norm(t.to(DT))) for t in (*checks, *params, *deltas)]
    count, moved = len(checks), len(params)
    if not all(math.isfinite(n) for n in norms[:count]):
        return False
    for p, size, step in zip(params, norms[count : count + moved], norms[count + moved :]):
        if not size + step <= torch.finfo(p.dtype).max:
            return False
    return True


@pytest.mark.parametrize("seed", range(6))
def test_finite_check_verdict_from_host_norms_is_the_per_tensor_rule(seed):
    """Random checked tensors, parameters and steps of float32, float64 and bfloat16, some with
    inf or NaN entries or near their dtype's largest value: the host verdict is the rule's."""
    generator = torch.Generator().manual_seed(seed)
    dtypes = [torch.float32, DT, torch.bfloat16]

    def tensor(i):
        dtype = dtypes[i % 3]
        t = torch.randn(4, generator=generator).to(dtype)
        kind = int(torch.randint(0, 6, (1,), generator=generator))
        if kind == 0:
            t[1] = math.inf
        elif kind == 1:
            t[2] = math.nan
        elif kind == 2:
            t = t.sign().to(dtype) * 0.6 * torch.finfo(dtype).max
        return t

    for trial in range(20):
        checks = [tensor(i) for i in range(trial % 3)]
        params = [tensor(i) for i in range(3)]
        deltas = [tensor(i).to(p.dtype) for i, p in enumerate(params)]
        found = _within_range(checks, params, deltas)
        assert found == _reference_verdict(checks, params, deltas)
        norms = _norms([*checks, *params], 2)
        assert all(isinstance(n, float) for n in norms)
        for n, t in zip(norms, [*checks, *params]):
            reference = float(torch.linalg.vector_norm(t))
            assert n == reference or (math.isnan(n) and math.isnan(reference))


def test_finite_check_reads_norms_taken_already():
    """The ``normed`` norms (the gradients' of ``_unused``) count as taken: a non-finite one
    fails the verdict without its tensor being read again."""
    param, delta, grad = torch.ones(3), torch.ones(3), torch.ones(3)
    assert _within_range([grad], [param], [delta], [([grad], [math.sqrt(3.0)])])
    assert not _within_range([grad], [param], [delta], [([grad], [math.inf])])


def test_ekfac_trust_products_at_the_default_are_the_dense_quadratics(monkeypatch):
    """Under the default damping the trust region reads ``Σ (K + λ) ⊙ c²`` of the solve's
    coordinates ``c`` (two foreach calls for all parameters): per parameter the dense
    ``vec(D)ᵀ (Q diag(vec K + λ) Qᵀ) vec(D)`` of its direction ``D``, ``Q = Q_B ⊗ Q_A``."""
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).double())
    lossfunc = curvopt.extend(nn.CrossEntropyLoss())
    opt = EKFAC(model.parameters(), lr=0.1, curvature_interval=2)
    generator = torch.Generator().manual_seed(1)
    seen = []
    measured = trust_region._measured

    def recording(items, step):
        held = len(opt._coordinates or {})  # the solve's coordinates, kept for the products
        read = measured(items, step)
        kept = held > 0 and not opt._coordinates  # all read by the products
        seen.append((kept, step.damping, [(item, item.direction.clone()) for item in items], read))
        return read

    monkeypatch.setattr(trust_region, "_measured", recording)
    for _ in range(4):
        X = torch.randn(8, 5, dtype=DT, generator=generator)
        y = torch.randint(0, 3, (8,), generator=generator)
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        opt.step()
    checked = 0
    for kept, damping, items, read in seen:
        for (item, direction), product in zip(items, read):
            metric = item.update.state.get("trust_curvature")
            if metric is None:
                continue
            rows = item.curvature[1].shape[0] if len(item.curvature) > 1 else 1
            sides = [*item.curvature[1:], None, None][:2]  # a missing side: the identity
            eye = (torch.eye(rows, dtype=DT), torch.eye(metric.numel() // rows, dtype=DT))
            q = torch.kron(*(e if b is None else b for b, e in zip(sides, eye)))
            dense = q @ torch.diag(metric.reshape(-1) + damping) @ q.T
            expected = direction.reshape(-1) @ dense @ direction.reshape(-1)
            torch.testing.assert_close(product, expected, rtol=1e-10, atol=0)
            checked += kept
    assert checked >= 8  # the coordinates' path, at plain steps and refreshes alike
