"""curvopt's strided-view im2col (``curvopt/layers/unfold.py``) against ``unfoldNd``.

``unfoldNd`` builds the patches independently (a convolution with a one-hot kernel), for
1d/2d/3d inputs; both must agree exactly in layout ``[N, C * prod(k), L]``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from unfoldNd import unfoldNd

from curvopt.layers.unfold import unfold, unfold_conv_input

# (spatial size, kernel, dilation, padding, stride) per dimension count
CASES = [
    ((7,), (3,), (1,), (0,), (1,)),
    ((9,), (2,), (3,), (2,), (2,)),
    ((6, 5), (3, 2), (1, 1), (1, 0), (1, 1)),
    ((8, 7), (3, 3), (2, 1), (2, 1), (2, 3)),
    ((5, 4, 6), (2, 3, 2), (1, 1, 2), (1, 0, 1), (1, 2, 1)),
    ((4, 5, 5), (3, 1, 2), (1, 2, 1), (0, 1, 0), (2, 1, 2)),
]


@pytest.mark.parametrize("size, kernel, dilation, padding, stride", CASES)
def test_unfold_matches_unfoldNd(size, kernel, dilation, padding, stride):
    x = torch.randn(2, 3, *size, dtype=torch.float64)
    expected = unfoldNd(x, kernel, dilation=dilation, padding=padding, stride=stride)
    actual = unfold(x, kernel, dilation, padding, stride)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize("padding, mode", [("same", "zeros"), (1, "circular"), (2, "reflect")])
def test_conv_module_patches_honour_string_padding_and_padding_modes(dim, padding, mode):
    conv_cls = (nn.Conv1d, nn.Conv2d, nn.Conv3d)[dim - 1]
    conv = conv_cls(2, 3, 3, padding=padding, padding_mode=mode, dilation=1).double()
    x = torch.randn(2, 2, *([5] * dim), dtype=torch.float64)
    if mode == "zeros":
        padded, pad = x, conv._reversed_padding_repeated_twice[::2][::-1]
    else:
        padded, pad = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode), (0,) * dim
    expected = unfoldNd(padded, conv.kernel_size, conv.dilation, pad, conv.stride)
    patches = unfold_conv_input(conv, x)
    torch.testing.assert_close(patches, expected, rtol=0, atol=0)
    # and the patches are what the convolution multiplies with its flattened weight
    out = conv.weight.flatten(1) @ patches + conv.bias[:, None]
    torch.testing.assert_close(out, conv(x).flatten(2))
