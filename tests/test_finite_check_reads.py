"""The step's finite check reads each tensor once: the gradients' ℓ2 norms that the test for
unused parameters took (``base._unused``) serve the check too, and the checked tensors, the
parameters and the steps are normed by one foreach call (``base._within_range``). The verdict
and its error are those of the exact look at every entry.
"""

import pytest
import torch
from conftest import free_earlier_optimizers
from torch import nn

import curvopt
from curvopt.optim import KFAC, DiagGGNNewton
from curvopt.optim.base import _norms, check_finite
from curvopt.optim.plan import ParamUpdate


@pytest.fixture(autouse=True)
def _no_other_optimizer():
    free_earlier_optimizers()


def _update(param, grad, delta):
    update = ParamUpdate(param, "parameter 'w' (shape (3,))", delta)
    update.checks += [("gradient", grad), ("update", delta)]
    return update


def test_norms_are_in_the_tensors_order_as_host_floats():
    """One Python float per tensor (read in one host read), each its own dtype's norm."""
    dense = [torch.randn(3, 2, dtype=torch.float32), torch.randn(4, dtype=torch.float64)]
    sparse = torch.sparse_coo_tensor([[0, 2, 0]], [1.0, 2.0, 3.0], (3,))  # uncoalesced
    tensors = [dense[0], sparse, dense[1]]
    norms = _norms(tensors, 2)
    expected = [torch.linalg.vector_norm(t.to_dense().double()) for t in tensors]
    assert all(type(norm) is float for norm in norms)
    torch.testing.assert_close(
        torch.tensor(norms, dtype=torch.float64), torch.stack(expected), rtol=1e-6, atol=0
    )
    assert norms[2] == float(torch.linalg.vector_norm(dense[1]))  # float64: exact
    assert _norms([], 2) == []


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_gradient_normed_already_is_still_checked(bad):
    param, delta = torch.ones(3), torch.full((3,), 0.5)
    grad = torch.tensor([1.0, bad, 0.0])
    normed = [([grad], _norms([grad], 2))]
    with pytest.raises(FloatingPointError, match="the gradient of parameter 'w'.* not finite"):
        check_finite([_update(param, grad, delta)], normed=normed)
    # the same verdict as without the norms taken ahead
    with pytest.raises(FloatingPointError, match="the gradient of parameter 'w'.* not finite"):
        check_finite([_update(param, grad, delta)])


def test_a_normed_tensor_that_is_not_checked_adds_no_error():
    param, grad, delta = torch.ones(3), torch.ones(3), torch.full((3,), 0.5)
    other = torch.tensor([float("nan")])  # normed, but no tensor of the plan: the exact look
    check_finite([_update(param, grad, delta)], normed=[([other], _norms([other], 2))])


def test_an_update_that_overflows_is_caught_with_gradients_normed_ahead():
    param = torch.full((3,), 3e38)
    grad, delta = torch.ones(3), torch.full((3,), -3e38)
    normed = [([grad], _norms([grad], 2))]
    with pytest.raises(FloatingPointError, match="parameter after the step"):
        check_finite([_update(param, grad, delta)], normed=normed)


def _model():
    torch.manual_seed(0)
    model = curvopt.extend(nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)))
    return model, curvopt.extend(nn.CrossEntropyLoss())


@pytest.mark.parametrize("optimizer", [KFAC, DiagGGNNewton])
def test_a_plain_step_norms_each_gradient_parameter_and_step_once(optimizer, monkeypatch):
    model, lossfunc = _model()
    opt = optimizer(model.parameters(), lr=0.1, curvature_interval=5)
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    read = []
    foreach_norm = torch._foreach_norm

    def counted(tensors, *args, **kwargs):
        read.extend(id(t) for t in tensors)
        return foreach_norm(tensors, *args, **kwargs)

    for _ in range(2):  # a refresh, then a plain step
        opt.zero_grad()
        lossfunc(model(X), y).backward()
        if opt._group_state[0]["step"] == 1:
            monkeypatch.setattr(torch, "_foreach_norm", counted)
        opt.step()
    monkeypatch.undo()
    params = list(model.parameters())
    deltas = len(params)  # one step per parameter, each normed once
    grads = [id(p.grad) for p in params]
    assert all(read.count(g) == 1 for g in grads)
    assert all(read.count(id(p)) == 1 for p in params)
    assert len(read) == 2 * len(params) + deltas


def test_a_plain_step_with_a_non_finite_gradient_raises_and_changes_nothing():
    model, lossfunc = _model()
    opt = KFAC(model.parameters(), lr=0.1, curvature_interval=5)
    X, y = torch.randn(8, 4), torch.randint(0, 3, (8,))
    opt.zero_grad()
    lossfunc(model(X), y).backward()
    opt.step()
    opt.zero_grad()
    lossfunc(model(X), y).backward()
    before = [p.detach().clone() for p in model.parameters()]
    model[2].weight.grad[0, 0] = float("nan")
    with pytest.raises(FloatingPointError, match=r"the gradient of parameter #2 .* not finite"):
        opt.step()
    for p, old in zip(model.parameters(), before):
        assert torch.equal(p.detach(), old)
