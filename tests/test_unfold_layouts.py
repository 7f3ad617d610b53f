"""The positions-first patch layout (one copy, used by the Kronecker input factor of convs)
equals the transposed channels-first layout with each patch's features kernel position-major,
and the channels-first layout equals ``F.unfold`` for 2-D; a Gram matrix of positions-first
patches reordered channel-major is the Gram matrix of the channel-major patches."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvopt.layers.unfold import kernel_major_to_channel_major, unfold, unfold_conv_input
from curvopt.core.reductions import gram

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
    n, c = shape[:2]
    kernel_major = channels_first.reshape(n, c, -1, channels_first.shape[-1]).permute(0, 3, 2, 1)
    torch.testing.assert_close(rows, kernel_major.flatten(2), rtol=0, atol=0)
    if len(kernel) == 2:
        expected = F.unfold(x, kernel, dilation=dilation, padding=padding, stride=stride)
        torch.testing.assert_close(channels_first, expected, rtol=0, atol=0)


@pytest.mark.parametrize("padding,mode", [("same", "zeros"), (1, "reflect"), (2, "circular")])
def test_module_patches_in_both_layouts(padding, mode):
    conv = nn.Conv2d(2, 3, 3, padding=padding, padding_mode=mode, dtype=DT)
    x = torch.randn(2, 2, 6, 5, generator=torch.Generator().manual_seed(1), dtype=DT)
    rows = unfold_conv_input(conv, x, positions_first=True)
    kernel_major = unfold_conv_input(conv, x).reshape(2, 2, 9, -1).permute(0, 3, 2, 1)
    torch.testing.assert_close(rows, kernel_major.flatten(2), rtol=0, atol=0)
    weight = conv.weight.flatten(2).transpose(1, 2).flatten(1)  # [C_out, k C_in]
    out = (rows @ weight.T + conv.bias).transpose(1, 2)
    torch.testing.assert_close(out.reshape(conv(x).shape), conv(x))


@pytest.mark.parametrize("rows", [40, 7], ids=["full-rank", "with-root"])
def test_kernel_major_gram_reordered_channel_major(rows):
    """3 channels, 4 kernel positions; fewer rows than features: the Gram root is reordered
    too (its Gram is the reordered matrix)."""
    g = torch.Generator().manual_seed(2)
    channel_major = torch.randn(rows, 3, 4, generator=g, dtype=DT)  # features (c, k)
    kernel_major = channel_major.transpose(1, 2).reshape(rows, 12)  # features (k, c)
    want = gram(channel_major.reshape(rows, 12), 0.5)
    got = kernel_major_to_channel_major(gram(kernel_major, 0.5), 3)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    root = getattr(got, "gram_root", None)
    assert (root is not None) == (rows < 12)
    if root is not None:
        torch.testing.assert_close(root.T @ root, want, rtol=0, atol=1e-12)
