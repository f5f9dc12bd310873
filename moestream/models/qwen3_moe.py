"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing (renormalized if norm_topk_prob), no
shared expert; dense layers where mlp_only_layers / decoder_sparse_step say."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from moestream.layers.experts import RoutedExperts
from moestream.layers.rope import Rope
from moestream.models import base

EXPERT_MODULE = "mlp"  # model.layers.N.mlp.experts.E.gate_proj.weight
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}


@dataclass
class ModelArgs(base.BaseModelArgs):
    EXPERT_INTERMEDIATE: ClassVar[str] = "moe_intermediate_size"
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


sanitize = base.sanitize  # checkpoint names kept, rotary buffers left out
quant_predicate = base.routers_keep_8_bits(".mlp.gate.weight")


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)

    def ffn(p: str, i: int):
        if args.is_moe_layer(i):
            return base.routed_moe(loader, p + "mlp.", i, args, route, experts)
        return base.dense_mlp(loader, p + "mlp.", args.hidden_size, args.intermediate_size)

    return base.build_layers(loader, args, rope, lambda p, i: base.attention(
        loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="head"), ffn)
