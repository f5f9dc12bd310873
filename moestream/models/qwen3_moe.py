"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing (renormalized if norm_topk_prob), no
shared expert; dense layers where mlp_only_layers / decoder_sparse_step say."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
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


def quant_predicate(name: str, bits: int | None) -> int | None:
    """Bits a resident matrix is stored at (None: float): the router keeps at least 8."""
    return base.router_bits(bits) if name.endswith(".mlp.gate.weight") else bits


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    H = args.hidden_size
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="head")
        if args.is_moe_layer(i):
            router = loader.take(p + "mlp.gate.weight", (args.num_experts, H))
            ffn = MoEBlock(i, router, route, experts, top_k=args.num_experts_per_tok)
        else:
            ffn = base.dense_mlp(loader, p + "mlp.", H, args.intermediate_size)
        layers.append(base.decoder_layer(loader, p, args, attn, ffn))
    return base.transformer(loader, args, rope, layers)
