"""im2col for 1d/2d/3d convolutions: ``x [N, C, *S] -> [N, C * prod(k), L]``.

Column ``l`` holds the input patch that output location ``l`` of the convolution sees, with
rows ordered channel-major then kernel position, i.e. like ``weight.flatten(1)``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from unfoldNd import unfoldNd


def unfold(x: torch.Tensor, kernel_size, dilation, padding, stride) -> torch.Tensor:
    """Patches of ``x`` (zero padding ``padding``) as ``[N, C * prod(kernel), L]``."""
    dims = x.dim() - 2
    if dims == 2:
        return F.unfold(x, kernel_size, dilation=dilation, padding=padding, stride=stride)
    if dims == 1:
        return F.unfold(
            x.unsqueeze(2),
            (1, kernel_size[0]),
            dilation=(1, dilation[0]),
            padding=(0, padding[0]),
            stride=(1, stride[0]),
        )
    return unfoldNd(x, kernel_size, dilation=dilation, padding=padding, stride=stride)


def unfold_conv_input(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The patches a ``ConvNd`` module convolves, honouring string padding and padding modes."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        padding = module.padding
    else:
        pad_mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
        x = F.pad(x, module._reversed_padding_repeated_twice, mode=pad_mode)
        padding = (0,) * (x.dim() - 2)
    return unfold(x, module.kernel_size, module.dilation, padding, module.stride)
