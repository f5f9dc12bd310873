"""Mixtral: every layer sparse, top-k weights always renormalized and kept in float32, experts named
w1/w3/w2 under block_sparse_moe."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope
from moestream.models import base

EXPERT_MODULE = "block_sparse_moe"  # model.layers.N.block_sparse_moe.experts.E.w1.weight
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


@dataclass
class ModelArgs(base.BaseModelArgs):
    rms_norm_eps: float = 1e-5


sanitize = base.sanitize  # checkpoint names kept, rotary buffers left out


def quant_predicate(name: str, bits: int | None) -> int | None:
    return base.router_bits(bits) if name.endswith(".block_sparse_moe.gate.weight") else bits


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    H = args.hidden_size
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=True, float32_weights=True)  # weights kept in float32
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias)
        router = loader.take(p + "block_sparse_moe.gate.weight", (args.num_experts, H))
        ffn = MoEBlock(i, router, route, experts, top_k=args.num_experts_per_tok)
        layers.append(base.decoder_layer(loader, p, args, attn, ffn))
    return base.transformer(loader, args, rope, layers)
