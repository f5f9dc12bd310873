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


def sigmoid_group_topk(logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor | None, n_group: int,
                       topk_group: int, normalize: bool, scaling: float, out_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing, in float32: sigmoid scores; the choice adds a per-expert correction
    bias and keeps only the `topk_group` best of `n_group` expert groups (a group's score: the sum
    of its two best); the weights are the chosen experts' plain sigmoid scores, optionally
    renormalized, times `scaling`."""
    scores = torch.sigmoid(logits.to(torch.float32))  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    if topk_group < n_group:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).to(out_dtype), ids
