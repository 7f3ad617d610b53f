"""The positions-first patch layout (one copy, used by the Kronecker input factor of convs)
equals the transposed channels-first layout, which ``F.unfold`` checks for 2-D."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvopt.layers.unfold import unfold, unfold_conv_input

DT = torch.float64


@pytest.mark.parametrize(
    "shape,kernel,dilation,padding,stride",
    [
        ((2, 3, 9), (3,), (2,), (1,), (2,)),
        ((2, 3, 7, 6), (3, 2), (1, 2), (1, 0), (2, 1)),
        ((2, 2, 5, 4, 6), (2, 3, 2), (1, 1, 2), (0, 1, 1), (1, 2, 1)),
    ],
)
def test_positions_first_is_the_transpose(shape, kernel, dilation, padding, stride):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=DT)
    channels_first = unfold(x, kernel, dilation, padding, stride)
    rows = unfold(x, kernel, dilation, padding, stride, positions_first=True)
    assert rows.is_contiguous()
    torch.testing.assert_close(rows, channels_first.transpose(1, 2), rtol=0, atol=0)
    if len(kernel) == 2:
        expected = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        torch.testing.assert_close(channels_first, expected, rtol=0, atol=0)


@pytest.mark.parametrize("padding,mode", [("same", "zeros"), (1, "reflect"), (2, "circular")])
def test_module_patches_in_both_layouts(padding, mode):
    conv = nn.Conv2d(2, 3, 3, padding=padding, padding_mode=mode, dtype=DT)
    x = torch.randn(2, 2, 6, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    rows = unfold_conv_input(conv, x, positions_first=True)
    torch.testing.assert_close(rows, unfold_conv_input(conv, x).transpose(1, 2), rtol=0, atol=0)
    out = (rows @ conv.weight.flatten(1).T + conv.bias).transpose(1, 2)
    torch.testing.assert_close(out.reshape(conv(x).shape), conv(x))
