"""Router functions: router logits [T, E] -> (weights [T, A], ids [T, A]).

A family picks one (and its options) in its model file. Each works row by row, so a token's
choice never depends on the other tokens computed with it."""
from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, *, normalize: bool, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top k, optionally renormalized to sum to 1 (one
    Triton kernel on CUDA, the torch ops elsewhere: the same choice and weights)."""
    if logits.is_cuda:
        try:
            from moestream.kernels.triton_route import route_topk
        except ImportError:  # no Triton: the torch ops below
            pass
        else:
            return route_topk(logits, top_k, normalize=normalize, out_dtype=out_dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(out_dtype), ids
