"""An extended pass leaves autograd free to take each gradient over (``core/passgrad.py``).

When ``p.grad`` is ``None``, autograd's ``AccumulateGrad`` makes the incoming gradient
``p.grad`` itself unless something else references it; the pass's hooks keep no reference then,
so ``p.grad`` is the very tensor the backward produced (its address seen by a hook of the user's
on ``p``, which keeps no reference either) and no operator copies it. Where a hook of the
user's changes the gradient (a new tensor returned from a tensor hook, ``p.grad`` changed in
place by a post-accumulate-grad hook), the sum checks and every value still use the gradient
the backward produced, as before: every value checked in float64 against per-sample loops.
"""

import copy

import pytest
import torch
from conftest import DT, assert_close, per_sample_grads_loop
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import curvopt
from curvopt import extensions as ext

N = 6
CE = nn.CrossEntropyLoss()
EXTENSIONS = {
    "BatchGrad": lambda: [ext.BatchGrad()],
    "Variance": lambda: [ext.Variance(), ext.SumGradSquared()],
    "DiagGGNExact": lambda: [ext.DiagGGNExact()],
    "KFAC": lambda: [ext.KFAC()],
}


def _setup(seed=0):
    torch.manual_seed(seed)
    plain = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).to(DT)
    x, y = torch.randn(N, 4, dtype=DT), torch.randint(0, 3, (N,))
    return plain, x, y


class _Copies(TorchDispatchMode):
    """Counts the operators that allocate a gradient's copy (``new_empty_strided``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.new_empty_strided.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("name", list(EXTENSIONS))
def test_parameter_grad_is_the_tensor_autograd_produced(name):
    plain, x, y = _setup()
    model = copy.deepcopy(plain)
    seen = {}
    for key, p in model.named_parameters():  # (before extend: the user's hook runs first)
        p.register_hook(lambda g, key=key: seen.__setitem__(key, g.data_ptr()))
    model, lossfunc = curvopt.extend(model), curvopt.extend(nn.CrossEntropyLoss())
    for step in range(2):  # (the second pass: a structure whose sums were checked)
        model.zero_grad(set_to_none=True)
        loss = lossfunc(model(x), y)
        with curvopt.collect(*EXTENSIONS[name]()), _Copies() as copies:
            loss.backward()
        assert copies.count == 0, f"{name}, pass {step}: {copies.count} gradient copies"
        for key, p in model.named_parameters():
            assert p.grad.data_ptr() == seen[key], f"{name}, pass {step}: {key} copied"
    grads = per_sample_grads_loop(plain, CE, x, y)
    for key, p in model.named_parameters():
        assert_close(p.grad, grads[key].sum(0), key)
        if name == "BatchGrad":
            assert_close(p.grad_batch, grads[key], key)
        if name == "Variance":
            assert_close(p.variance, grads[key].var(0, unbiased=False), key)
            assert_close(p.sum_grad_squared, grads[key].square().sum(0), key)


def test_hook_returning_a_new_gradient_checks_the_backward_gradient():
    """A tensor hook after ``extend``'s that returns ``2 g``: ``p.grad`` is ``2 g``, while the
    per-sample values and their sum check are those of ``g``, the backward's gradient."""
    plain, x, y = _setup(1)
    model, lossfunc = curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss())
    for p in model.parameters():
        p.register_hook(lambda g: 2 * g)
    with curvopt.collect(ext.BatchGrad(), ext.Variance()):
        lossfunc(model(x), y).backward()
    _assert_doubled_grad_and_backward_moments(model, plain, x, y)


def _assert_doubled_grad_and_backward_moments(model, plain, x, y):
    """``p.grad`` is twice the backward's gradient; ``grad_batch`` and ``variance`` are those
    of the backward's per-sample gradients (a loop over samples)."""
    grads = per_sample_grads_loop(plain, CE, x, y)
    for key, p in model.named_parameters():
        assert_close(p.grad, 2 * grads[key].sum(0), key)
        assert_close(p.grad_batch, grads[key], key)
        assert_close(p.variance, grads[key].var(0, unbiased=False), key)


def test_post_accumulate_hook_changing_grad_in_place_checks_the_backward_gradient():
    """A post-accumulate-grad hook doubling ``p.grad`` in place: the sums are checked against
    the gradient the backward produced (kept, autograd copies it: the old behaviour)."""
    plain, x, y = _setup(2)
    model, lossfunc = curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss())

    def double(q):
        q.grad.mul_(2)

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(double)
    for _ in range(2):  # (the second pass: a structure whose sums were checked)
        model.zero_grad(set_to_none=True)
        with curvopt.collect(ext.BatchGrad(), ext.Variance(), ext.DiagGGNExact()):
            lossfunc(model(x), y).backward()
    _assert_doubled_grad_and_backward_moments(model, plain, x, y)


def test_tied_parameter_still_raises_without_a_kept_gradient():
    """The sum check still catches a gradient from outside the module (a penalty on the
    weight) when the pass keeps no reference to the gradient."""
    plain, x, y = _setup(3)
    model, lossfunc = curvopt.extend(copy.deepcopy(plain)), curvopt.extend(nn.CrossEntropyLoss())
    with pytest.raises(curvopt.errors.UnsupportedModuleError, match="outside the module"):
        with curvopt.collect(ext.BatchGrad()):
            (lossfunc(model(x), y) + model[0].weight.square().sum()).backward()
