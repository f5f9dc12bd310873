"""Mixtral: every layer sparse, top-k weights always renormalized and kept in float32, experts named
w1/w3/w2 under block_sparse_moe."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.layers.experts import RoutedExperts
from moestream.layers.rope import Rope
from moestream.models import base

EXPERT_MODULE = "block_sparse_moe"  # model.layers.N.block_sparse_moe.experts.E.w1.weight
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass
class ModelArgs(base.BaseModelArgs):
    rms_norm_eps: float = 1e-5


sanitize = base.sanitize  # checkpoint names kept, rotary buffers left out
quant_predicate = base.routers_keep_8_bits(".block_sparse_moe.gate.weight")


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=True, float32_weights=True)  # weights kept in float32
    return base.build_layers(
        loader, args, rope, lambda p, i: base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias),
        lambda p, i: base.routed_moe(loader, p + "block_sparse_moe.", i, args, route, experts))
