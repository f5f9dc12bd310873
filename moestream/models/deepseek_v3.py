"""DeepSeek-V3 (and Kimi-K2, which ships this config): multi-head latent attention with a latent KV
cache (moestream.layers.mla), YaRN rope, sigmoid group-limited routing with a score correction bias
and a routed scaling factor, shared experts beside the routed ones, dense first layers.

The checkpoint's multi-token-prediction layers (`model.layers.<num_hidden_layers + j>...`, see
moestream.models.mtp) are built apart from the decoder by `build_mtp`. FP8 block-scaled checkpoints (`weight_scale_inv`) are dequantized by
convert (moestream.quant.fp8) before they reach this family."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import partial
from typing import ClassVar

import torch

from moestream.errors import UnsupportedModelError
from moestream.layers.experts import RoutedExperts
from moestream.kv.layout import LayerKV
from moestream.layers.mla import MLAShape, MLAttention, MLAWeights
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope, rope_parameters, yarn_inv_freq_and_scale, yarn_softmax_scale
from moestream.layers.routers import sigmoid_topk
from moestream.layers.transformer import DecoderLayer, MoETransformer
from moestream.models import base, mtp

EXPERT_MODULE = "mlp"  # model.layers.N.mlp.experts.E.gate_proj.weight
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}


@dataclass
class ModelArgs(mtp.NextNArgs, base.BaseModelArgs):
    EXPERT_INTERMEDIATE: ClassVar[str] = "moe_intermediate_size"
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "yarn")
    moe_intermediate_size: int = 2048
    n_shared_experts: int = 1
    kv_lora_rank: int = 512
    q_lora_rank: int | None = 1536
    qk_rope_head_dim: int = 64
    qk_nope_head_dim: int = 128
    v_head_dim: int = 128
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope_interleave: bool = True
    scoring_func: str = "sigmoid"
    topk_method: str = "noaux_tc"
    rope: dict = field(default_factory=dict)  # config.json's rope parameters (rope_scaling / rope_parameters)
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers after the decoder's

    @classmethod
    def from_dict(cls, config: dict):
        if config.get("num_key_value_heads") is None:  # unused by latent attention; transformers defaults it so
            config = {**config, "num_key_value_heads": config.get("num_attention_heads")}
        args = super().from_dict(config)
        args.rope = rope_parameters(config)
        args.max_position_embeddings = config.get("max_position_embeddings", args.max_position_embeddings)
        # the query/key width: what the memory ledger's activation estimate counts per head
        args.head_dim = args.qk_nope_head_dim + args.qk_rope_head_dim
        args.check()
        return args

    def check(self) -> None:
        if self.scoring_func != "sigmoid" or self.topk_method not in ("noaux_tc", None):
            raise UnsupportedModelError(f"routing {self.scoring_func}/{self.topk_method} is not supported "
                                        "(only sigmoid scores with noaux_tc)")
        if self.num_experts % self.n_group or self.topk_group > self.n_group:
            raise UnsupportedModelError(f"n_group {self.n_group} / topk_group {self.topk_group} do not fit "
                                        f"{self.num_experts} experts")
        if self.rope.get("partial_rotary_factor", 1.0) != 1.0:
            raise UnsupportedModelError("partial_rotary_factor is not supported with latent attention")

    def is_moe_layer(self, i: int) -> bool:
        return self.num_experts > 0 and i >= self.first_k_dense_replace and i % self.moe_layer_freq == 0

    def largest_intermediate(self) -> int:
        return max(super().largest_intermediate(), self.moe_intermediate_size * self.n_shared_experts)

    def mla_shape(self) -> MLAShape:
        return MLAShape(self.num_attention_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                        self.v_head_dim)

    def expanded_kv_width(self) -> int:
        """Prefill expands the latent to every head's key (nope + rope) and value."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim

    def kv_layout(self) -> list[LayerKV]:
        """Every layer caches the latent and the rotary key, one row per token."""
        return [self.mla_shape().cache_layout()] * self.num_hidden_layers


sanitize = base.sanitize
quant_predicate = base.routers_keep_8_bits(".mlp.gate.weight")


def route(args: ModelArgs, correction_bias, logits):
    return sigmoid_topk(logits, args.num_experts_per_tok, correction_bias=correction_bias, n_group=args.n_group,
                        topk_group=args.topk_group, normalize=args.norm_topk_prob, scaling=args.routed_scaling_factor,
                        out_dtype=logits.dtype)


def rope_for(args: ModelArgs, device) -> Rope:
    """The rotary key's table: YaRN frequencies and cos/sin scale where config.json asks."""
    if args.rope["rope_type"] == "yarn":
        config = {"rope_scaling": args.rope, "max_position_embeddings": args.max_position_embeddings}
        inv_freq, factor = yarn_inv_freq_and_scale(config, args.qk_rope_head_dim, args.rope_theta)
        return Rope(args.qk_rope_head_dim, args.rope_theta, device, inv_freq=inv_freq, scale=factor)
    return Rope(args.qk_rope_head_dim, args.rope_theta, device)


def mla(loader, prefix: str, args: ModelArgs, rope: Rope) -> MLAttention:
    H, s = args.hidden_size, args.mla_shape()
    qk, R, Rq = s.nope_dim + s.rope_dim, s.kv_lora_rank, args.q_lora_rank
    w = MLAWeights(kv_a=loader.take(prefix + "kv_a_proj_with_mqa.weight", (R + s.rope_dim, H)),
                   kv_a_norm=loader.take(prefix + "kv_a_layernorm.weight", (R,)),
                   kv_b=loader.take(prefix + "kv_b_proj.weight", (s.num_heads * (s.nope_dim + s.v_dim), R)),
                   o=loader.take(prefix + "o_proj.weight", (H, s.num_heads * s.v_dim)))
    if Rq is None:
        w.q = loader.take(prefix + "q_proj.weight", (s.num_heads * qk, H))
    else:
        w.q_a = loader.take(prefix + "q_a_proj.weight", (Rq, H))
        w.q_a_norm = loader.take(prefix + "q_a_layernorm.weight", (Rq,))
        w.q_b = loader.take(prefix + "q_b_proj.weight", (s.num_heads * qk, Rq))
    if args.attention_bias:
        w.kv_a_bias = loader.take(prefix + "kv_a_proj_with_mqa.bias", (R + s.rope_dim,))
        w.o_bias = loader.take(prefix + "o_proj.bias", (H,))
        if Rq is not None:
            w.q_a_bias = loader.take(prefix + "q_a_proj.bias", (Rq,))
    config = {"rope_scaling": args.rope, "max_position_embeddings": args.max_position_embeddings}
    scale = yarn_softmax_scale(config) / math.sqrt(qk)
    return MLAttention(w, rope, s, scale=scale, eps=args.rms_norm_eps, interleaved=args.rope_interleave)


def decoder_layer(loader, p: str, args: ModelArgs, rope: Rope, layer: int, experts: RoutedExperts, *,
                  moe: bool, attention=mla) -> DecoderLayer:
    """Layer `layer` at prefix `p`: `attention` (latent by default), then the MoE block (expert layer
    `layer`) or a dense MLP."""
    H = args.hidden_size
    attn = attention(loader, p + "self_attn.", args, rope)
    if moe:
        m = p + "mlp."
        # the choice compares scores a bf16 rounding would reorder: router and bias stay float32,
        # the logits computed in float32 (as transformers computes them)
        bias = loader.take(m + "gate.e_score_correction_bias", (args.num_experts,), dtype=torch.float32)
        shared = (base.shared_expert(loader, m + "shared_experts.", H, args.moe_intermediate_size * args.n_shared_experts)
                  if args.n_shared_experts else None)
        router = loader.take(m + "gate.weight", (args.num_experts, H), dtype=torch.float32)
        ffn = MoEBlock(layer, router, partial(route, args, bias), experts, top_k=args.num_experts_per_tok, shared=shared)
    else:
        ffn = base.dense_mlp(loader, p + "mlp.", H, args.intermediate_size)
    return base.decoder_layer(loader, p, args, attn, ffn)


def build(args: ModelArgs, loader, experts: RoutedExperts, *, rope: Rope | None = None,
          attention=mla) -> MoETransformer:
    rope = rope_for(args, loader.device) if rope is None else rope
    layers = [decoder_layer(loader, f"model.layers.{i}.", args, rope, i, experts, moe=args.is_moe_layer(i),
                            attention=attention) for i in range(args.num_hidden_layers)]
    return base.transformer(loader, args, rope, layers)


def build_mtp(args: ModelArgs, loader, experts: RoutedExperts, model: MoETransformer, count: int, *,
              attention=mla):
    """The first `count` MTP layers: each a decoder layer with routed experts past the last one."""
    out = []
    for i in range(args.num_hidden_layers, args.num_hidden_layers + count):
        p = f"model.layers.{i}."
        block = decoder_layer(loader, p, args, model.rope, i, experts, moe=True, attention=attention)
        out.append(mtp.nextn_layer(loader, args, p, block, model, args.kv_layout()[0]))
    return out
