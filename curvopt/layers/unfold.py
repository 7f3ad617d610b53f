"""im2col for 1d/2d/3d convolutions: ``x [N, C, *S] -> [N, C * prod(k), L]``.

Column ``l`` holds the input patch that output location ``l`` of the convolution sees, with
rows ordered channel-major then kernel position, i.e. like ``weight.flatten(1)`` (the
positions-first layout orders them kernel position-major: see :func:`unfold`). Built as one
strided view of the padded input, copied once (several times faster on CPU than
``F.unfold``'s im2col loop, and the same code for every dimension).
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn


def unfold(
    x: torch.Tensor,
    kernel_size: Sequence[int],
    dilation: Sequence[int],
    padding: Sequence[int],
    stride: Sequence[int],
    positions_first: bool = False,
) -> torch.Tensor:
    """Patches of ``x`` (zero padding ``padding`` on both sides) as ``[N, C * prod(k), L]``, or,
    with ``positions_first``, as ``[N, L, prod(k) * C]`` with the features of a patch ordered
    kernel position-major, then channel (copied once from a channels-last input, whose channels
    are contiguous: faster than gathering the kernel-width runs of the channel-major order;
    :func:`kernel_major_to_channel_major` reorders a Gram matrix of them)."""
    if any(padding):
        x = F.pad(x, [p for p in reversed(padding) for _ in range(2)])
    n, c, *size = x.shape
    out = [
        (s - d * (k - 1) - 1) // st + 1 for s, k, d, st in zip(size, kernel_size, dilation, stride)
    ]
    if positions_first:
        x = x.movedim(1, -1).contiguous()  # [N, *S, C]
        spatial_strides, channel_stride = x.stride()[1:-1], x.stride(-1)
        view = x.as_strided(
            (n, *out, *kernel_size, c),
            (
                x.stride(0),
                *(st * s for st, s in zip(spatial_strides, stride)),
                *(st * d for st, d in zip(spatial_strides, dilation)),
                channel_stride,
            ),
        )
        return view.reshape(n, math.prod(out), math.prod(kernel_size) * c)
    spatial_strides = x.stride()[2:]
    view = x.as_strided(
        (n, c, *kernel_size, *out),
        (
            x.stride(0),
            x.stride(1),
            *(st * d for st, d in zip(spatial_strides, dilation)),
            *(st * s for st, s in zip(spatial_strides, stride)),
        ),
    )
    return view.reshape(n, c * math.prod(kernel_size), math.prod(out))


def kernel_major_to_channel_major(factor: torch.Tensor, channels: int) -> torch.Tensor:
    """A Gram matrix ``[D, D]`` of positions-first patches (features kernel position-major)
    reordered channel-major, like ``weight.flatten(1)``; its Gram root (``reductions.gram_root``)
    too, where it carries one."""
    d = factor.shape[0]
    k = d // channels
    out = factor.view(k, channels, k, channels).permute(1, 0, 3, 2).reshape(d, d)
    root = getattr(factor, "gram_root", None)
    if root is not None:
        out.gram_root = root.view(-1, k, channels).transpose(1, 2).reshape(-1, d)
    return out


def padded_conv_input(module: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, tuple]:
    """``(x', padding)``: the input of a ``ConvNd`` module and the zero padding on both sides
    that its convolution applies to ``x'`` (string padding and padding modes applied to ``x'``
    already, with ``padding`` 0)."""
    if module.padding_mode == "zeros" and not isinstance(module.padding, str):
        return x, tuple(module.padding)
    pad_mode = "constant" if module.padding_mode == "zeros" else module.padding_mode
    x = F.pad(x, module._reversed_padding_repeated_twice, mode=pad_mode)
    return x, (0,) * (x.dim() - 2)


def unfold_conv_input(
    module: nn.Module, x: torch.Tensor, positions_first: bool = False
) -> torch.Tensor:
    """The patches a ``ConvNd`` module convolves, honouring string padding and padding modes
    (layout as in :func:`unfold`)."""
    x, padding = padded_conv_input(module, x)
    return unfold(x, module.kernel_size, module.dilation, padding, module.stride, positions_first)
