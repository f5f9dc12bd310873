"""GLM-4.5 / GLM-4.6 (glm4_moe): sigmoid router scores with a learned correction bias that steers
only the choice (group-limited when n_group > 1), normalized top-k times routed_scaling_factor,
shared experts beside the routed ones, the first `first_k_dense_replace` layers dense, partial
rotary (partial_rotary_factor, 0.5 by default), q/k biases, optional per-head q/k RMSNorm. Its
multi-token-prediction layers follow DeepSeek-V3's naming (moestream.models.mtp)."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import ClassVar

import torch

from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope
from moestream.layers.routers import sigmoid_topk
from moestream.layers.transformer import DecoderLayer, MoETransformer
from moestream.kv.layout import LayerKV
from moestream.models import base, mtp

EXPERT_MODULE = "mlp"  # model.layers.N.mlp.experts.E.gate_proj.weight
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}
CORRECTION_BIAS = "mlp.gate.e_score_correction_bias"


@dataclass
class ModelArgs(base.BaseModelArgs):
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

    def mtp_layer_count(self) -> int:
        return mtp.nextn_count(self)

    def is_mtp_weight(self, name: str) -> bool:
        return mtp.is_nextn_weight(self, name)


def sanitize(name: str) -> str | None:
    """Rotary buffers are not weights."""
    return None if name.endswith("rotary_emb.inv_freq") else name


def quant_predicate(name: str, bits: int | None) -> int | None:
    """The router keeps at least 8 bits (the correction bias is a vector: always float)."""
    return base.router_bits(bits) if name.endswith(".mlp.gate.weight") else bits


def route(args: ModelArgs, correction_bias: torch.Tensor, logits: torch.Tensor):
    return sigmoid_topk(logits, args.num_experts_per_tok, correction_bias=correction_bias, n_group=args.n_group,
                        topk_group=args.topk_group, normalize=args.norm_topk_prob, scaling=args.routed_scaling_factor,
                        out_dtype=logits.dtype)


def decoder_layer(loader, p: str, args: ModelArgs, rope: Rope, layer: int, experts: RoutedExperts, *,
                  moe: bool) -> DecoderLayer:
    H, E = args.hidden_size, args.num_experts
    attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias,
                          qk_norm="head" if args.use_qk_norm else None)
    if moe:
        m = p + "mlp."
        # the choice compares scores that differ in the third decimal: router and bias stay float32,
        # the logits computed in float32 (as transformers computes them)
        router = loader.take(m + "gate.weight", (E, H), dtype=torch.float32)
        bias = loader.take(p + CORRECTION_BIAS, (E,), dtype=torch.float32)
        shared = base.shared_expert(loader, m + "shared_experts.", H, args.moe_intermediate_size * args.n_shared_experts)
        ffn = MoEBlock(layer, router, partial(route, args, bias), experts, top_k=args.num_experts_per_tok, shared=shared)
    else:
        ffn = base.dense_mlp(loader, p + "mlp.", H, args.intermediate_size)
    return DecoderLayer(attn, ffn, *base.norms(loader, p, H), args.rms_norm_eps)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> MoETransformer:
    rope = Rope.from_params(args.rope_parameters, args.head_dim, args.max_position_embeddings, loader.device)
    layers = [decoder_layer(loader, f"model.layers.{i}.", args, rope, i, experts, moe=args.is_moe_layer(i))
              for i in range(args.num_hidden_layers)]
    embed, final_norm, lm_head = base.embeddings(loader, args)
    return MoETransformer(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, rope=rope,
                          eps=args.rms_norm_eps)


def build_mtp(args: ModelArgs, loader, experts: RoutedExperts, model: MoETransformer, count: int):
    """The first `count` MTP layers (DeepSeek-V3's naming, moestream.models.mtp)."""
    kv = LayerKV(args.num_key_value_heads, args.head_dim)
    out = []
    for i in range(args.num_hidden_layers, args.num_hidden_layers + count):
        p = f"model.layers.{i}."
        block = decoder_layer(loader, p, args, model.rope, i, experts, moe=True)
        out.append(mtp.nextn_layer(loader, args, p, block, model, kv))
    return out
