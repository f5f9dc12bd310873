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


def quant_predicate(name: str, bits: int | None) -> int | None:
    """The router and the shared expert's gate keep at least 8 bits."""
    return base.router_bits(bits) if name.endswith((".mlp.gate.weight", ".shared_expert_gate.weight")) else bits


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    H = args.hidden_size
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.qkv_bias)
        if args.is_moe_layer(i):
            ffn = base.gated_shared_moe(loader, p + "mlp.", i, args, route, experts)
        else:
            ffn = base.dense_mlp(loader, p + "mlp.", H, args.intermediate_size)
        layers.append(base.decoder_layer(loader, p, args, attn, ffn))
    return base.transformer(loader, args, rope, layers)
