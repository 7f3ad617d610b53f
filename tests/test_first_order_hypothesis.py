"""Property sweep over convolution hyper-parameters (1-3d, transposed or not): BatchGrad,
BatchL2Grad, SumGradSquared and Variance against the per-sample loop reference."""

import math

import torch
from conftest import DT, check_against_loop
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch import nn

CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


@st.composite
def conv_case(draw):
    dims = draw(st.integers(1, 3))
    transposed = draw(st.booleans())
    groups = draw(st.sampled_from([1, 2]))
    c_in = groups * draw(st.integers(1, 2))
    c_out = groups * draw(st.integers(1, 2))
    max_k = {1: 4, 2: 3, 3: 2}[dims]
    kernel = tuple(draw(st.integers(1, max_k)) for _ in range(dims))
    stride = tuple(draw(st.integers(1, 3)) for _ in range(dims))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(dims))
    bias = draw(st.booleans())
    kwargs = dict(stride=stride, dilation=dilation, groups=groups, bias=bias)
    if transposed:
        padding = tuple(draw(st.integers(0, (d * (k - 1)) // 2)) for k, d in zip(kernel, dilation))
        # output_padding < max(stride, dilation); may exceed stride when dilation is larger
        output_padding = tuple(
            draw(st.integers(0, max(s, d) - 1)) for s, d in zip(stride, dilation)
        )
        kwargs.update(padding=padding, output_padding=output_padding)
        module = CONV_T[dims](c_in, c_out, kernel, **kwargs)
        size = tuple(draw(st.integers(1, 4 if dims < 3 else 3)) for _ in range(dims))
    else:
        mode = draw(st.sampled_from(["zeros", "zeros", "reflect", "replicate", "circular"]))
        use_same = draw(st.booleans()) and all(s == 1 for s in stride)
        if use_same:
            padding = "same"
        else:
            padding = tuple(draw(st.integers(0, 2)) for _ in range(dims))
        kwargs.update(padding=padding, padding_mode=mode)
        # input large enough for the receptive field and for reflect padding (pad < size)
        min_size = [max(d * (k - 1) + 1, 3) for k, d in zip(kernel, dilation)]
        size = tuple(draw(st.integers(m, m + 2)) for m in min_size)
        module = CONV[dims](c_in, c_out, kernel, **kwargs)
    n = draw(st.integers(1, 3))
    return module, (n, c_in, *size)


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(case=conv_case(), reduction=st.sampled_from(["mean", "sum"]))
def test_conv_sweep(case, reduction):
    module, shape = case
    torch.manual_seed(0)
    module = module.to(DT)
    x = torch.randn(*shape, dtype=DT)
    with torch.no_grad():
        out = module(x)
    assert math.prod(out.shape) > 0
    target = torch.randn_like(out)
    check_against_loop(module, nn.MSELoss(reduction=reduction), x, target)
