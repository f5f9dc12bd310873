"""Gemma 4 (text): sliding-window and full-attention layers (`layer_types`) with their own head
size, KV heads and rotary table (default on sliding layers, proportional partial rotary on full
ones; full layers may reuse keys as values, `attention_k_eq_v`), q/k/v RMSNorms and score scale 1,
sandwich norms, GELU(tanh) MLPs with routed experts beside the dense MLP in every layer
(`enable_moe_block`), a router with its own norm, scale and per-expert scale, embeddings scaled by
sqrt(hidden), tied embeddings and soft-capped logits.

Not supported (refused at load): per-layer input embeddings (`hidden_size_per_layer_input`), KV
sharing between layers (`num_kv_shared_layers`), bidirectional attention, and dense models
(`enable_moe_block` false)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from moestream.errors import UnsupportedModelError
from moestream.layers.experts import RoutedExperts
from moestream.layers.gelu_mlp import GeluMLP
from moestream.kv.layout import LayerKV
from moestream.layers.rope_proportional import rope_for
from moestream.layers.sandwich import GemmaRouter, ParallelMoEBlock, SandwichFFN, SandwichLayer
from moestream.layers.softcap_transformer import SoftcapTransformer
from moestream.layers.attention import Attention, AttentionWeights
from moestream.layers.norm_f32 import rms_norm_f32
from moestream.models import base

EXPERT_MODULE = ""  # model.layers.N.experts.gate_up_proj: the experts hang off the layer itself
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}
EXPERT_ACTIVATION = "gelu_tanh"  # routed experts are GELU(tanh)-gated (QuantSpec.activation)
EXPERT_EXPORT = "fused"  # transformers reads Gemma 4's experts as fused stacks only

FULL, SLIDING = "full_attention", "sliding_attention"
DEFAULT_ROPE = {SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1_000_000.0}}
NORMS = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_feedforward_layernorm_1",
         "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")


def _refuse_missing_features(config: dict, family: str) -> None:
    """One line per feature this file does not build, before anything is read."""
    if not config.get("enable_moe_block"):
        raise UnsupportedModelError(f"{family}: a dense model (enable_moe_block is off); moestream runs MoE models")
    if config.get("hidden_size_per_layer_input"):
        raise UnsupportedModelError(f"{family}: per-layer input embeddings (hidden_size_per_layer_input="
                                    f"{config['hidden_size_per_layer_input']}) are not supported yet")
    if config.get("num_kv_shared_layers"):
        raise UnsupportedModelError(f"{family}: KV sharing between layers (num_kv_shared_layers="
                                    f"{config['num_kv_shared_layers']}) is not supported yet")
    if config.get("use_bidirectional_attention") == "all":
        raise UnsupportedModelError(f"{family}: bidirectional attention (use_bidirectional_attention='all') is not supported")
    if config.get("attention_bias"):
        raise UnsupportedModelError(f"{family}: attention biases are not supported")
    if config.get("hidden_activation", "gelu_pytorch_tanh") != "gelu_pytorch_tanh":
        raise UnsupportedModelError(f"{family}: hidden_activation {config['hidden_activation']!r} is not supported "
                                    "(gelu_pytorch_tanh)")


@dataclass
class ModelArgs(base.BaseModelArgs):
    EXPERT_INTERMEDIATE: ClassVar[str] = "moe_intermediate_size"
    moe_intermediate_size: int | None = None
    enable_moe_block: bool = True
    tie_word_embeddings: bool = True
    sliding_window: int = 512
    final_logit_softcapping: float | None = None
    attention_k_eq_v: bool = False
    layer_types: list[str] = dataclasses.field(default_factory=list)
    rope_parameters: dict = dataclasses.field(default_factory=dict)
    # per layer: (KV heads, head size), from per_layer_config or global_head_dim / num_global_key_value_heads
    layer_shapes: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, config: dict):
        family = config.get("model_type", "gemma4_text")
        _refuse_missing_features(config, family)
        values = {**config, "rope_parameters": None, "rope_scaling": None}
        if values.get("num_experts_per_tok") is None:
            values["num_experts_per_tok"] = config.get("top_k_experts")
        args = super().from_dict(values)
        L = args.num_hidden_layers
        types = list(config.get("layer_types") or [SLIDING if (i + 1) % 6 else FULL for i in range(L)])
        if len(types) != L or any(t not in (FULL, SLIDING) for t in types):
            raise UnsupportedModelError(f"{family}: layer_types must be {L} of {FULL!r} / {SLIDING!r}")
        types[-1] = FULL  # as the reference forces it
        args.layer_types = types
        args.rope_parameters = {**DEFAULT_ROPE, **(config.get("rope_parameters") or {})}
        args.layer_shapes = [_layer_shape(config, args, i) for i in range(L)]
        return args

    def is_moe_layer(self, i: int) -> bool:
        return self.enable_moe_block

    def largest_intermediate(self) -> int:
        return max(self.intermediate_size or 0, self.moe_intermediate_size or 0)

    def kv_layout(self) -> list[LayerKV]:
        return [LayerKV(heads, dim, window=self.sliding_window if kind == SLIDING else None)
                for (heads, dim), kind in zip(self.layer_shapes, self.layer_types)]

    def expanded_kv_width(self) -> int:
        """K/V are expanded to every query head at the widest layer's head size."""
        return 2 * max(dim for _, dim in self.layer_shapes)

    def head_dim_of(self, layer_type: str) -> int:
        return next(d for (_, d), t in zip(self.layer_shapes, self.layer_types) if t == layer_type)


def _layer_shape(config: dict, args: ModelArgs, i: int) -> tuple[int, int]:
    """(KV heads, head size) of layer i, as transformers resolves them."""
    heads, dim = args.num_key_value_heads, args.head_dim
    per_layer = config.get("per_layer_config")
    if per_layer is not None:
        override = per_layer.get(str(i), per_layer.get(i)) or {}
        return override.get("num_key_value_heads", heads), override.get("head_dim", dim)
    if args.layer_types[i] != FULL:
        return heads, dim
    global_heads = config.get("num_global_key_value_heads") if args.attention_k_eq_v else None
    return global_heads or heads, config.get("global_head_dim") or 512


sanitize = base.sanitize
quant_predicate = base.routers_keep_8_bits(".router.proj.weight")


def build(args: ModelArgs, loader, experts: RoutedExperts) -> SoftcapTransformer:
    H, Nq, E, eps = args.hidden_size, args.num_attention_heads, args.num_experts, args.rms_norm_eps
    ropes = {t: rope_for(args.rope_parameters[t], args.head_dim_of(t), loader.device) for t in set(args.layer_types)}
    layers = []
    for i, (kind, (Nkv, D)) in enumerate(zip(args.layer_types, args.layer_shapes)):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        k_eq_v = args.attention_k_eq_v and kind == FULL
        w = AttentionWeights(
            q=loader.take_matrix(a + "q_proj.weight", (Nq * D, H)), k=loader.take_matrix(a + "k_proj.weight", (Nkv * D, H)),
            v=None if k_eq_v else loader.take_matrix(a + "v_proj.weight", (Nkv * D, H)),
            o=loader.take_matrix(a + "o_proj.weight", (H, Nq * D)),
            q_norm=loader.take(a + "q_norm.weight", (D,)), k_norm=loader.take(a + "k_norm.weight", (D,)))
        w.fuse_qkv()
        # the q/k norms bound the scores: scale 1; values get a scale-free norm
        attn = Attention(w, ropes[kind], num_heads=Nq, num_kv_heads=Nkv, head_dim=D, eps=eps, qk_norm="head",
                         norm=rms_norm_f32, window=args.sliding_window if kind == SLIDING else None, scale=1.0,
                         v_norm=True)
        mlp = GeluMLP(*base.swiglu_weights(loader, p + "mlp.", H, args.intermediate_size))
        scalar = loader.take(p + "layer_scalar", (1,))
        if args.is_moe_layer(i):
            norms = {n: loader.take(f"{p}{n}.weight", (H,)) for n in NORMS}
            router = GemmaRouter(proj=loader.take(p + "router.proj.weight", (E, H)),
                                 scale=loader.take(p + "router.scale", (H,)),
                                 per_expert_scale=loader.take(p + "router.per_expert_scale", (E,)),
                                 top_k=args.num_experts_per_tok, eps=eps)
            ffn = ParallelMoEBlock(i, router, experts, mlp=mlp, norms=norms, scalar=scalar, eps=eps)
        else:
            ffn = SandwichFFN(mlp, loader.take(p + "pre_feedforward_layernorm.weight", (H,)),
                              loader.take(p + "post_feedforward_layernorm.weight", (H,)), scalar, eps)
        layers.append(SandwichLayer(attn, ffn, loader.take(p + "input_layernorm.weight", (H,)),
                                    loader.take(p + "post_attention_layernorm.weight", (H,)), eps))
    embed, final_norm, lm_head = base.embeddings(loader, args)
    return SoftcapTransformer(embed_scale=H ** 0.5, softcap=args.final_logit_softcapping, embed=embed, layers=layers,
                              final_norm=final_norm, lm_head=lm_head, eps=eps)
