"""The failure check of the damped factors' Cholesky (a scalar ``info`` read as it is, a stack's
reduced) and the trace-norm ratio's masked quotient, against float64 dense references."""

import math

import pytest
import torch

from curvopt.optim import cholesky_factor, cholesky_inverse, trace_norm_pi

DT = torch.float64


def spd(d, seed):
    gen = torch.Generator().manual_seed(seed)
    root = torch.randn(d, d, generator=gen, dtype=DT)
    return root @ root.T / d + 0.1 * torch.eye(d, dtype=DT)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stacked_cholesky_inverse_is_each_matrix_inverse(seed):
    stack = torch.stack([spd(5, seed), spd(5, seed + 10), spd(5, seed + 20)])
    inverses = cholesky_inverse(stack)
    for inverse, matrix in zip(inverses, stack):
        torch.testing.assert_close(inverse, torch.linalg.inv(matrix))
        # one matrix alone: the same to rounding (LAPACK's batched routine may block a stack's
        # matrices otherwise than one matrix's: bit for bit on an Intel host, not on an AMD one)
        torch.testing.assert_close(inverse, cholesky_inverse(matrix), rtol=1e-13, atol=0)


@pytest.mark.parametrize("bad", [0, 2])
def test_stacked_cholesky_raises_when_any_matrix_is_indefinite(bad):
    stack = torch.stack([spd(4, 0), spd(4, 1), spd(4, 2)])
    stack[bad] = -torch.eye(4, dtype=DT)
    with pytest.raises(torch.linalg.LinAlgError, match="increase the damping"):
        cholesky_inverse(stack)
    with pytest.raises(torch.linalg.LinAlgError, match="increase the damping"):
        cholesky_factor(stack)


def test_stacked_float32_cholesky_retries_in_float64():
    """A float32 stack whose float32 Cholesky fails for one matrix only: the whole stack is
    factorised again in float64, and ``L Lᵀ`` reproduces every matrix."""
    for seed in range(200):  # spectrum 1 ... 1e-9 rounded to float32: about one in five fails
        gen = torch.Generator().manual_seed(seed)
        basis, _ = torch.linalg.qr(torch.randn(4, 4, generator=gen, dtype=DT))
        near = ((basis * torch.logspace(0, -9, 4, dtype=DT)) @ basis.T).float()
        near = (near + near.T) / 2
        fails32 = torch.linalg.cholesky_ex(near)[1] != 0
        if fails32 and torch.linalg.cholesky_ex(near.double())[1] == 0:
            break
    else:
        pytest.fail("no near-singular float32 test matrix found")
    stack = torch.stack([spd(4, 5).float(), near])
    factor = cholesky_factor(stack)
    assert factor.dtype == torch.float32
    for L, matrix in zip(factor, stack):
        torch.testing.assert_close(L.double() @ L.double().T, matrix.double(), rtol=1e-5, atol=1e-7)


def test_trace_norm_pi_of_stacked_factors_with_a_zero_group():
    """Per group ``π = sqrt((tr A / dim A) / (tr B / dim B))``; 1 for the group whose ``B`` is
    zero (its quotient ``x / 0`` is masked, no inf or nan leaks)."""
    B = torch.stack([spd(3, 0), torch.zeros(3, 3, dtype=DT), spd(3, 1)])
    A = torch.stack([spd(2, 2), spd(2, 3), torch.zeros(2, 2, dtype=DT)])
    pi = trace_norm_pi([B, A])
    expected = math.sqrt((A[0].trace() / 2) / (B[0].trace() / 3))
    assert pi.tolist() == pytest.approx([expected, 1.0, 1.0])
    assert torch.isfinite(pi).all()
