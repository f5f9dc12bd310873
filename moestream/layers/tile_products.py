"""The products over a decode step's fixed row tile on CUDA (moestream.engine.decoder): with a
step's rows at once, the q/k/v, o, router and shared-expert products and the head take all
MAX_STEP_TOKENS rows of the residual stream whatever T, through moestream.kernels.triton_rows, which
streams each weight once per product. A row's bits depend on nothing but its own row (and, being the
same kernels, not on the cache size)."""
from __future__ import annotations

import torch


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [R, K], R <= triton_rows.MAX_ROWS."""
    from moestream.kernels import triton_rows

    return triton_rows.tile_linear(x, weight, bias)
