"""OLMoE: RMSNorm over the full q and k projections (before heads are split), optional q/k/v
clipping, every layer sparse, softmax top-k routing."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope
from moestream.models import base

EXPERT_MODULE = "mlp"
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}


@dataclass
class ModelArgs(base.BaseModelArgs):
    rms_norm_eps: float = 1e-5
    norm_topk_prob: bool = False
    clip_qkv: float | None = None


sanitize = base.sanitize  # checkpoint names kept, rotary buffers left out


def quant_predicate(name: str, bits: int | None) -> int | None:
    return base.router_bits(bits) if name.endswith(".mlp.gate.weight") else bits


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    H = args.hidden_size
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="full",
                              clip_qkv=args.clip_qkv)
        router = loader.take(p + "mlp.gate.weight", (args.num_experts, H))
        ffn = MoEBlock(i, router, route, experts, top_k=args.num_experts_per_tok)
        layers.append(base.decoder_layer(loader, p, args, attn, ffn))
    return base.transformer(loader, args, rope, layers)
