"""The sandwich-norm decoder layer (Gemma 4): every sub-block's output is normed before it joins
the residual, and an MoE layer runs its routed experts beside (not instead of) the dense MLP:

    h   = x + post_attn(attn(input(x)))
    out = (h + post_ffn(post_ffn_1(mlp(pre_ffn(h))) + post_ffn_2(experts(pre_ffn_2(h))))) * scalar

The router reads h itself (`GemmaRouter`). For the engine's decoder the layer offers the usual
pair: `attention_rows` -> (h, the experts' input), and an `ffn` that is either a dense
`SandwichFFN` or a `ParallelMoEBlock` (route / shared_out / combine, with the dense MLP as its
shared part). The decoder hands `route` and `shared_out` only the experts' input, so
`attention_rows` leaves h with the block (`ParallelMoEBlock.pending`) for the two calls that
follow it in the same segment."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from moestream.layers.experts import RoutedExperts
from moestream.layers.gelu_mlp import GeluMLP
from moestream.kv.pool import LayerCache
from moestream.layers.attention import Attention
from moestream.layers.moe import MoEBlock
from moestream.layers.norm_f32 import rms_norm_f32


@dataclass
class GemmaRouter:
    """Scale-free RMSNorm of h, times `scale` [H] and H^-1/2, projected to expert scores; softmax in
    float32, top k renormalized to sum 1, then times the chosen experts' `per_expert_scale`."""

    proj: torch.Tensor  # [E, H]
    scale: torch.Tensor  # [H]
    per_expert_scale: torch.Tensor  # [E]
    top_k: int
    eps: float

    def __call__(self, h: torch.Tensor, *, linear=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
        x = rms_norm_f32(h, None, self.eps) * self.scale * (h.shape[-1] ** -0.5)
        probs = torch.softmax(linear(x, self.proj), dim=-1, dtype=torch.float32)  # [T, E]
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights * self.per_expert_scale[ids]).to(h.dtype), ids


class SandwichFFN:
    """A dense layer's feed-forward half: (h + post(mlp(pre(h)))) * scalar, called as ffn(h, residual=h)."""

    def __init__(self, mlp: GeluMLP, pre: torch.Tensor, post: torch.Tensor, scalar: torch.Tensor, eps: float):
        self.mlp, self.pre, self.post, self.scalar, self.eps = mlp, pre, post, scalar, eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        residual = x if residual is None else residual
        return (residual + rms_norm_f32(self.mlp(rms_norm_f32(x, self.pre, self.eps)), self.post, self.eps)) * self.scalar


class ParallelMoEBlock(MoEBlock):
    """Routed experts beside a dense MLP (its `shared` part), each with its own pre/post norms."""

    def __init__(self, layer: int, router: GemmaRouter, experts: RoutedExperts, *, mlp: GeluMLP,
                 norms: dict[str, torch.Tensor], scalar: torch.Tensor, eps: float):
        super().__init__(layer, router.proj, router, experts, top_k=router.top_k)
        self.gemma_router, self.mlp, self.norms, self.scalar, self.eps = router, mlp, norms, scalar, eps
        self.pending: torch.Tensor | None = None  # h of the token attention_step just computed

    def _norm(self, x: torch.Tensor, name: str) -> torch.Tensor:
        return rms_norm_f32(x, self.norms[name], self.eps)

    def experts_input(self, h: torch.Tensor) -> torch.Tensor:
        return self._norm(h, "pre_feedforward_layernorm_2")

    def route_h(self, h: torch.Tensor, linear=F.linear) -> tuple[torch.Tensor, torch.Tensor]:
        weights, ids = self.gemma_router(h, linear=linear)
        if self.experts.reroute is not None:  # benchmarks only: routing at a known hit rate
            weights, ids = self.experts.reroute(self.layer, weights, ids)
        return weights, ids

    def dense_h(self, h: torch.Tensor, linear=F.linear) -> torch.Tensor:
        return self._norm(self.mlp(self._norm(h, "pre_feedforward_layernorm"), linear=linear),
                          "post_feedforward_layernorm_1")

    def fuses(self, dtype: torch.dtype, max_experts: int | None = None) -> bool:
        """Never: its router (GemmaRouter) is no plain softmax top-k over x."""
        return False

    # the decoder's interface: x is the experts' input; h is `pending`
    def route(self, x: torch.Tensor, *, linear=F.linear, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self.route_h(self.pending, linear)

    def shared_out(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor:
        return self.dense_h(self.pending, linear)

    def combine(self, routed: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        out = self._norm(shared + self._norm(routed, "post_feedforward_layernorm_2"), "post_feedforward_layernorm")
        return (residual + out) * self.scalar

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The whole feed-forward half for h [T, H] (prefill)."""
        weights, ids = self.route_h(h)
        routed = self.experts(self.layer, self.experts_input(h), ids, weights)
        return self.combine(routed, self.dense_h(h), h)


@dataclass
class SandwichLayer:
    attn: Attention
    ffn: SandwichFFN | ParallelMoEBlock
    input_norm: torch.Tensor
    post_attn_norm: torch.Tensor
    eps: float
    writes_split: ClassVar[bool] = False  # (attention_rows takes no `split`: its experts copy their input)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor,
                 kv: LayerCache) -> torch.Tensor:
        """A prefill chunk x [T, H]."""
        h = x + rms_norm_f32(self.attn.forward(rms_norm_f32(x, self.input_norm, self.eps), positions, sequences, kv),
                             self.post_attn_norm, self.eps)
        return self.ffn(h, residual=h)

    def attention_rows(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                       linear=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, the FFN's input): the experts' input on an MoE layer, h itself on a dense one."""
        a = self.attn.forward(rms_norm_f32(x, self.input_norm, self.eps), positions, sequences, kv, linear=linear)
        h = x + rms_norm_f32(a, self.post_attn_norm, self.eps)
        if isinstance(self.ffn, ParallelMoEBlock):
            self.ffn.pending = h
            return h, self.ffn.experts_input(h)
        return h, h

    def rows_input_norm(self) -> None:
        """No norm a caller computes for it (its norms scale in float32)."""
        return None
