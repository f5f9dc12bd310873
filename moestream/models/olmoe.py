"""OLMoE: RMSNorm over the full q and k projections (before heads are split), optional q/k/v
clipping, every layer sparse, softmax top-k routing."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.layers.experts import RoutedExperts
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
quant_predicate = base.routers_keep_8_bits(".mlp.gate.weight")


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    route = base.softmax_router(args, normalize=args.norm_topk_prob)
    return base.build_layers(
        loader, args, rope,
        lambda p, i: base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="full",
                                    clip_qkv=args.clip_qkv),
        lambda p, i: base.routed_moe(loader, p + "mlp.", i, args, route, experts))
