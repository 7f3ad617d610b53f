"""``curvopt.linalg`` on a model with gradient checkpointing: the torch.func operators raise
a curvopt error that says what to do; the collect-based operators give the plain model's
matrix."""

import numpy as np
import pytest
import torch
from torch.utils.checkpoint import checkpoint

import curvopt
from curvopt import linalg
from curvopt.errors import UnsupportedModuleError


class Checkpointed(torch.nn.Module):
    def __init__(self, reentrant, use_checkpoint=True):
        super().__init__()
        self.pre, self.a, self.b = (
            torch.nn.Linear(3, 3),
            torch.nn.Linear(3, 4),
            torch.nn.Linear(4, 2),
        )
        self.reentrant, self.use_checkpoint = reentrant, use_checkpoint

    def hidden(self, x):
        return torch.tanh(self.a(x))

    def forward(self, x):
        x = self.pre(x)  # a segment input that requires grad (reentrant checkpoint needs one)
        if self.use_checkpoint:
            h = checkpoint(self.hidden, x, use_reentrant=self.reentrant)
        else:
            h = self.hidden(x)
        return self.b(h)


def _problem(reentrant, use_checkpoint=True):
    torch.manual_seed(0)
    model = curvopt.extend(Checkpointed(reentrant, use_checkpoint).double())
    lossfunc = curvopt.extend(torch.nn.CrossEntropyLoss())
    data = [(torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,)))]
    return model, lossfunc, data


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("operator", [linalg.GGN, linalg.Hessian, linalg.EmpiricalFisher])
def test_torch_func_operators_name_checkpointing_and_the_fix(operator, reentrant):
    model, lossfunc, data = _problem(reentrant)
    op = operator(model, lossfunc, data)
    with pytest.raises(UnsupportedModuleError, match="gradient checkpointing"):
        op @ np.ones(op.shape[0])


@pytest.mark.parametrize("reentrant", [True, False])
@pytest.mark.parametrize("operator", [linalg.Diagonal, linalg.KFAC])
def test_collected_operators_equal_the_plain_models_exact_matrix(operator, reentrant):
    """``Diagonal`` against the diagonal of the plain model's exact GGN; ``KFAC`` (KFLR, one
    sample) against its exact blocks, so the checkpointed pass gives the GGN itself."""
    model, lossfunc, data = _problem(reentrant)
    plain, _, _ = _problem(reentrant, use_checkpoint=False)
    plain.load_state_dict(model.state_dict())
    if operator is linalg.KFAC:
        data = [(data[0][0][:1], data[0][1][:1])]
        op = operator(model, lossfunc, data, curvature="kflr")
    else:
        op = operator(model, lossfunc, data, curvature="ggn_exact")
    ggn = linalg.GGN(plain, lossfunc, data) @ np.eye(op.shape[0])
    dense = op @ np.eye(op.shape[0])
    if operator is linalg.KFAC:  # the parameters' diagonal blocks
        sizes = [p.numel() for p in model.parameters()]
        owner = np.repeat(np.arange(len(sizes)), sizes)
        ggn = ggn * (owner[:, None] == owner[None, :])
    else:
        ggn = np.diag(np.diag(ggn))
    assert np.abs(ggn).max() > 1e-3
    np.testing.assert_allclose(dense, ggn, rtol=1e-10, atol=1e-12)
