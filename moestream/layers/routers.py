"""Router functions: router logits [T, E] -> (weights [T, A], ids [T, A]).

A family picks one (and its options) in its model file. Each works row by row, so a token's
choice never depends on the other tokens computed with it."""
from __future__ import annotations

import torch

from moestream.kernels.reference import rowwise


def softmax_topk(logits: torch.Tensor, top_k: int, *, normalize: bool, out_dtype: torch.dtype,
                 expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over all experts in float32, the top k, optionally renormalized to sum to 1, times the
    chosen experts' expert_scale [E] where given (one Triton kernel on CUDA, the torch ops elsewhere:
    the same choice and weights)."""
    if logits.is_cuda:
        try:
            from moestream.kernels.triton_route import route_topk
        except ImportError:  # no Triton: the torch ops below
            pass
        else:
            return route_topk(logits, top_k, normalize=normalize, out_dtype=out_dtype, expert_scale=expert_scale)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if expert_scale is not None:
        weights = weights * expert_scale[ids]
    return weights.to(out_dtype), ids


def sigmoid_topk(logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor | None, n_group: int = 1,
                 topk_group: int = 1, normalize: bool, scaling: float = 1.0, out_dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Sigmoid scores in float32 (DeepSeek-V3 / GLM-4.5 style). The choice uses the scores plus a
    learned per-expert correction bias, and only experts of the `topk_group` best of `n_group`
    groups (a group scores the sum of its two best); the weights are the uncorrected scores,
    optionally renormalized, times `scaling`."""
    scores = rowwise(torch.sigmoid, logits.to(torch.float32))  # [T, E]
    choice = scores if correction_bias is None else scores + correction_bias.to(torch.float32)
    if n_group > 1 and topk_group < n_group:
        T, E = choice.shape
        grouped = choice.view(T, n_group, E // n_group)
        group_scores = grouped.topk(min(2, E // n_group), dim=-1).values.sum(dim=-1)  # [T, G]
        best = group_scores.topk(topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)
    ids = choice.topk(top_k, dim=-1).indices  # [T, A]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).to(out_dtype), ids


def topk_softmax(logits: torch.Tensor, top_k: int, *, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The top k logits, then a softmax over those k only (gpt-oss), in float32."""
    values, ids = torch.topk(logits.to(torch.float32), top_k, dim=-1)
    return torch.softmax(values, dim=-1).to(out_dtype), ids
