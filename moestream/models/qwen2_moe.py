"""Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate beside the routed experts, dense
layers by mlp_only_layers / decoder_sparse_step, softmax top-k routing."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from moestream.layers.experts import RoutedExperts
from moestream.layers.rope import Rope
from moestream.models import base

EXPERT_MODULE = "mlp"
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}


@dataclass
class ModelArgs(base.BaseModelArgs):
    EXPERT_INTERMEDIATE: ClassVar[str] = "moe_intermediate_size"
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    qkv_bias: bool = True  # transformers 4 always had q/k/v biases

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0

    def largest_intermediate(self) -> int:
        return max(super().largest_intermediate(), self.shared_expert_intermediate_size)


sanitize = base.sanitize  # checkpoint names kept, rotary buffers left out
quant_predicate = base.routers_keep_8_bits(".mlp.gate.weight", ".shared_expert_gate.weight")


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)

    def ffn(p: str, i: int):
        if args.is_moe_layer(i):
            return base.gated_shared_moe(loader, p + "mlp.", i, args, route, experts)
        return base.dense_mlp(loader, p + "mlp.", args.hidden_size, args.intermediate_size)

    return base.build_layers(
        loader, args, rope, lambda p, i: base.attention(loader, p + "self_attn.", args, rope, bias=args.qkv_bias), ffn)
