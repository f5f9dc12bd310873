"""Which kernel computes the products over a decode step's fixed row tile.

With a step's rows at once (moestream.engine.decoder), the q/k/v, o, router and shared-expert
products and the head take all MAX_STEP_TOKENS rows of the residual stream whatever T. "cublas":
F.linear; "triton": moestream.kernels.triton_rows.tile_linear, which streams the weights once per
product without a split-K reduce. Either way a row's bits depend on nothing but its own row (and,
being the same kernels, not on the cache size); the two give the same result within the dtype's
rounding, not the same bits."""
from __future__ import annotations

from typing import Callable

import torch.nn.functional as F

TILE_PRODUCTS = ("cublas", "triton")

Linear = Callable  # linear(x [R, K], weight [N, K], bias [N] | None = None) -> [R, N], as F.linear


def tile_linear(products: str) -> Linear:
    """The linear function of `products` (one of TILE_PRODUCTS); ValueError where it cannot run."""
    if products == "cublas":
        return F.linear
    if products != "triton":
        raise ValueError(f"rows products {products!r}: expected one of {', '.join(TILE_PRODUCTS)}")
    try:
        from moestream.kernels.triton_rows import tile_linear as triton_tile_linear
    except ImportError as exc:
        raise ValueError(f"rows products triton: Triton cannot be imported ({exc})") from None
    return triton_tile_linear
