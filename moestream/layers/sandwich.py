"""The sandwich-norm decoder layer (Gemma 4): every sub-block's output is normed before it joins
the residual, and an MoE layer runs its routed experts beside (not instead of) the dense MLP:

    h   = x + post_attn(attn(input(x)))
    out = (h + post_ffn(post_ffn_1(mlp(pre_ffn(h))) + post_ffn_2(experts(pre_ffn_2(h))))) * scalar

The router reads its own norm of h (`GemmaRouter`). For the engine's decoder the layer offers the
usual pair: `attention_rows` -> (h, the experts' input), and an `ffn` that is either a dense
`SandwichFFN` or a `ParallelMoEBlock` (route / shared_out / combine, with the dense MLP as its
shared part). The decoder hands `route` and `shared_out` only the experts' input, so
`attention_rows` leaves the MLP's and the router's inputs with the block (`ParallelMoEBlock.pending`)
for the two calls that follow it in the same segment."""
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
from moestream.layers.routers import softmax_topk


@dataclass
class GemmaRouter:
    """Projects the router's input (h's scale-free RMSNorm times `scale` [H] and H^-1/2: the fourth
    of `ParallelMoEBlock.tail`'s outputs) to expert scores; softmax in float32, top k renormalized
    to sum 1, then times the chosen experts' `per_expert_scale`."""

    proj: torch.Tensor  # [E, H]
    scale: torch.Tensor  # [H]
    per_expert_scale: torch.Tensor  # [E]
    top_k: int
    eps: float

    def __call__(self, x: torch.Tensor, *, linear=F.linear, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
        """fused: the decoder's router kernel that takes the product and the top-k at once."""
        if fused is not None:
            return fused(x, self.proj, self.top_k, normalize=True, out_dtype=x.dtype,
                         expert_scale=self.per_expert_scale)
        return softmax_topk(linear(x, self.proj), self.top_k, normalize=True, out_dtype=x.dtype,
                            expert_scale=self.per_expert_scale)


class SandwichFFN:
    """A dense layer's feed-forward half: (h + post(mlp(pre(h)))) * scalar, called as ffn(h, residual=h)."""

    def __init__(self, mlp: GeluMLP, pre: torch.Tensor, post: torch.Tensor, scalar: torch.Tensor, eps: float):
        self.mlp, self.pre, self.post, self.scalar, self.eps = mlp, pre, post, scalar, eps

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        residual = x if residual is None else residual
        return (residual + rms_norm_f32(self.mlp(rms_norm_f32(x, self.pre, self.eps)), self.post, self.eps)) * self.scalar


class ParallelMoEBlock(MoEBlock):
    """Routed experts beside a dense MLP (its `shared` part), each with its own pre/post norms.

    `tail` (called by the layer with attention's output) computes h and h's three norms at once and
    keeps the dense MLP's and the router's inputs (`pending`) for `route` and `shared_out`, which the
    decoder calls next with the experts' input; `combine` takes the raw MLP output and applies the
    post norms. On CUDA each side is one kernel (moestream.kernels.triton_sandwich)."""

    def __init__(self, layer: int, router: GemmaRouter, experts: RoutedExperts, *, mlp: GeluMLP,
                 norms: dict[str, torch.Tensor], scalar: torch.Tensor, eps: float):
        super().__init__(layer, router.proj, router, experts, top_k=router.top_k)
        self.gemma_router, self.mlp, self.norms, self.scalar, self.eps = router, mlp, norms, scalar, eps
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None  # (the MLP's, the router's input)

    def _kernels(self, *xs: torch.Tensor) -> bool:
        """Whether the Triton kernels take xs: on CUDA, xs and the weights they scale by of one dtype."""
        dtype = xs[0].dtype
        return xs[0].is_cuda and all(x.dtype == dtype for x in xs) and self.scalar.dtype == dtype and \
            self.gemma_router.scale.dtype == dtype

    def tail(self, x: torch.Tensor, a: torch.Tensor, post_attention: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (residual), a (attention's output) [T, H] -> (h, the experts' input); keeps `pending`."""
        n, router = self.norms, self.gemma_router
        scale = x.shape[-1] ** -0.5
        if self._kernels(x, a):
            from moestream.kernels.triton_sandwich import sandwich_tail
            h, mlp_in, experts_in, router_in = sandwich_tail(
                x.contiguous(), a.contiguous(), post_attention, n["pre_feedforward_layernorm"],
                n["pre_feedforward_layernorm_2"], router.scale, self.eps, scale)
        else:
            h = x + rms_norm_f32(a, post_attention, self.eps)
            mlp_in = rms_norm_f32(h, n["pre_feedforward_layernorm"], self.eps)
            experts_in = rms_norm_f32(h, n["pre_feedforward_layernorm_2"], self.eps)
            router_in = rms_norm_f32(h, None, self.eps) * router.scale * scale
        self.pending = (mlp_in, router_in)
        return h, experts_in

    # the decoder's interface: x is the experts' input; the MLP's and the router's are `pending`
    def route(self, x: torch.Tensor, *, linear=F.linear, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
        return self._rerouted(*self.gemma_router(self.pending[1], linear=linear, fused=fused))

    def fuses(self, dtype: torch.dtype, max_experts: int | None = None) -> bool:
        return self.router.dtype == dtype and (max_experts is None or self.num_experts <= max_experts)

    def shared_out(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor:
        return self.mlp(self.pending[0], linear=linear)

    def combine(self, routed: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        """routed (the experts' sum), shared (the raw MLP output), residual (h) -> the layer's output."""
        n = self.norms
        if self._kernels(residual, routed, shared):
            from moestream.kernels.triton_sandwich import sandwich_combine
            return sandwich_combine(routed.contiguous(), shared.contiguous(), residual.contiguous(),
                                    n["post_feedforward_layernorm_2"], n["post_feedforward_layernorm_1"],
                                    n["post_feedforward_layernorm"], self.scalar, self.eps)
        out = rms_norm_f32(rms_norm_f32(shared, n["post_feedforward_layernorm_1"], self.eps) +
                           rms_norm_f32(routed, n["post_feedforward_layernorm_2"], self.eps),
                           n["post_feedforward_layernorm"], self.eps)
        return (residual + out) * self.scalar

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The feed-forward half for the experts' input x [T, H] after `tail` (residual: h)."""
        weights, ids = self.route(x)
        return self.combine(self.experts(self.layer, x, ids, weights), self.shared_out(x), residual)


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
        h, hn = self.attention_rows(x, positions, sequences, kv)
        return self.ffn(hn, residual=h)

    def attention_rows(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                       linear=None) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, the FFN's input): the experts' input on an MoE layer, h itself on a dense one."""
        a = self.attn.forward(rms_norm_f32(x, self.input_norm, self.eps), positions, sequences, kv, linear=linear)
        if isinstance(self.ffn, ParallelMoEBlock):
            return self.ffn.tail(x, a, self.post_attn_norm)
        h = x + rms_norm_f32(a, self.post_attn_norm, self.eps)
        return h, h

    def rows_input_norm(self) -> None:
        """No norm a caller computes for it (its norms scale in float32)."""
        return None
