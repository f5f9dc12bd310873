"""GLM-4.5 / GLM-4.6 (glm4_moe): sigmoid router scores with a learned correction bias that steers
only the choice (group-limited when n_group > 1), normalized top-k times routed_scaling_factor,
shared experts beside the routed ones, the first `first_k_dense_replace` layers dense, partial
rotary (partial_rotary_factor, 0.5 by default), q/k biases, optional per-head q/k RMSNorm. Apart
from its attention, its layers and multi-token-prediction layers are DeepSeek-V3's (moestream.models.mtp)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moestream.layers.attention import Attention
from moestream.layers.experts import RoutedExperts
from moestream.layers.rope import Rope
from moestream.layers.transformer import MoETransformer
from moestream.models import base, deepseek_v3, mtp

EXPERT_MODULE = "mlp"  # model.layers.N.mlp.experts.E.gate_proj.weight
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}


@dataclass
class ModelArgs(mtp.NextNArgs, base.BaseModelArgs):
    EXPERT_INTERMEDIATE: ClassVar[str] = "moe_intermediate_size"
    moe_intermediate_size: int = 1408
    n_shared_experts: int = 1
    first_k_dense_replace: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    use_qk_norm: bool = False
    rms_norm_eps: float = 1e-5
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers after the decoder's

    @classmethod
    def from_dict(cls, config: dict):
        args = super().from_dict(config)
        # the config class defaults partial_rotary_factor to 0.5 where config.json leaves it out
        args.rope_parameters.setdefault("partial_rotary_factor", 0.5)
        if args.n_group < 1 or args.num_experts % args.n_group or not 1 <= args.topk_group <= args.n_group:
            raise base.FormatError(f"config.json: n_group={args.n_group}, topk_group={args.topk_group} do not divide "
                                   f"{args.num_experts} experts into groups")
        return args

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace

    def largest_intermediate(self) -> int:
        return max(super().largest_intermediate(), self.moe_intermediate_size * self.n_shared_experts)


sanitize = base.sanitize
# the router keeps at least 8 bits (the correction bias is a vector: always float)
quant_predicate = base.routers_keep_8_bits(".mlp.gate.weight")


def attention(loader, prefix: str, args: ModelArgs, rope: Rope) -> Attention:
    return base.attention(loader, prefix, args, rope, bias=args.attention_bias,
                          qk_norm="head" if args.use_qk_norm else None)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> MoETransformer:
    rope = Rope.from_params(args.rope_parameters, args.head_dim, args.max_position_embeddings, loader.device)
    return deepseek_v3.build(args, loader, experts, rope=rope, attention=attention)


def build_mtp(args: ModelArgs, loader, experts: RoutedExperts, model: MoETransformer, count: int):
    """The first `count` MTP layers (DeepSeek-V3's naming, moestream.models.mtp)."""
    return deepseek_v3.build_mtp(args, loader, experts, model, count, attention=attention)
