"""The products over a decode step's fixed row tile on CUDA (moestream.engine.decoder): with a
step's rows at once, the q/k/v, o, router and shared-expert products and the head take all
MAX_STEP_TOKENS rows of the residual stream whatever T, through moestream.kernels.triton_rows:
a dense weight streamed once per product, a packed one (moestream.layers.packed_matrix) read as its
codes and dequantized tile by tile. Either way a row's bits depend on nothing but its own row (and,
being the same kernels, not on the cache size)."""
from __future__ import annotations

import torch

from moestream.layers.packed_matrix import PackedMatrix


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [R, K], R <= triton_rows.MAX_ROWS."""
    from moestream.kernels import triton_rows

    if isinstance(weight, PackedMatrix) and not weight.view_ops:
        return triton_rows.packed_tile_linear(x, weight.codes, weight.scales, weight.biases, weight.bits, bias)
    return triton_rows.tile_linear(x, weight, bias)
