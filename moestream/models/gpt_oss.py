"""gpt-oss: sliding-window and full-attention layers (`layer_types`) with per-head sink logits and
biases on q/k/v/o, YaRN rotary, a router with a bias whose top-k logits are softmaxed, and routed
experts with biases and a clamped SwiGLU (gate ≤ limit, |up| ≤ limit, gate·sigmoid(alpha·gate)·(up+1)).

The experts are stored as fused stacks for x @ W with gate and up rows interleaved; convert
de-interleaves them into gate_proj / up_proj / down_proj records with their biases (EXPERT_FUSED).
OpenAI's MXFP4 expert blocks (`*_blocks` / `*_scales`, or GGUF MXFP4) become MXFP4 records that
keep their codes and scales (moestream.quant.mxfp4), or are dequantized and re-quantized when convert
is given --quant. On the CPU, 4- and 8-bit records run in the native kernels (moestream.cpu_share.kernels)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

import torch

from moestream.errors import UnsupportedModelError
from moestream.kv.layout import LayerKV
from moestream.layers.attention import Attention, AttentionWeights
from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope
from moestream.layers.routers import topk_softmax
from moestream.models import base

EXPERT_MODULE = "mlp"
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}
EXPERT_ACTIVATION = "clamped_swiglu"
EXPERT_FUSED = {"transposed": True, "interleaved": True, "bias": True}  # convert.layout.FusedLayout

FULL, SLIDING = "full_attention", "sliding_attention"


def expert_activation_params(config: dict) -> dict:
    """The clamped SwiGLU's settings, recorded in the experts' quant spec."""
    return {"alpha": float(config.get("swiglu_alpha", 1.702)), "limit": float(config.get("swiglu_limit", 7.0))}


@dataclass
class ModelArgs(base.BaseModelArgs):
    ROPE_TYPES: ClassVar[tuple[str, ...]] = ("default", "yarn")
    rms_norm_eps: float = 1e-5
    attention_bias: bool = True
    sliding_window: int | None = 128
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    layer_types: list[str] = dataclasses.field(default_factory=list)

    @classmethod
    def from_dict(cls, config: dict):
        family = config.get("model_type", "gpt_oss")
        args = super().from_dict(config)
        L = args.num_hidden_layers
        types = list(config.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(L)])
        if len(types) != L or any(t not in (FULL, SLIDING) for t in types):
            raise UnsupportedModelError(f"{family}: layer_types must be {L} of {FULL!r} / {SLIDING!r}")
        if SLIDING in types and not args.sliding_window:
            raise UnsupportedModelError(f"{family}: sliding layers need a positive sliding_window")
        args.layer_types = types
        return args

    def kv_layout(self) -> list[LayerKV]:
        """A sliding layer keeps only the blocks its window sees."""
        return [LayerKV(self.num_key_value_heads, self.head_dim, window=self.sliding_window if t == SLIDING else None)
                for t in self.layer_types]


sanitize = base.sanitize  # checkpoint names kept (the experts' stacks go to the converter's fused reader)


quant_predicate = base.routers_keep_8_bits(".mlp.router.weight")


def _attention(loader, prefix: str, args: ModelArgs, rope: Rope, window: int | None) -> Attention:
    H, D, Nq, Nkv = args.hidden_size, args.head_dim, args.num_attention_heads, args.num_key_value_heads
    bias = args.attention_bias

    def take(name, shape):
        return loader.take(prefix + name, shape)

    def matrix(name, shape):
        return loader.take_matrix(prefix + name, shape)

    w = AttentionWeights(q=matrix("q_proj.weight", (Nq * D, H)), k=matrix("k_proj.weight", (Nkv * D, H)),
                         v=matrix("v_proj.weight", (Nkv * D, H)), o=matrix("o_proj.weight", (H, Nq * D)),
                         sinks=take("sinks", (Nq,)))
    if bias:
        w.q_bias, w.k_bias, w.v_bias = take("q_proj.bias", (Nq * D,)), take("k_proj.bias", (Nkv * D,)), take("v_proj.bias", (Nkv * D,))
        w.o_bias = take("o_proj.bias", (H,))
    w.fuse_qkv()
    return Attention(w, rope, num_heads=Nq, num_kv_heads=Nkv, head_dim=D, qk_norm=None, eps=args.rms_norm_eps,
                     window=window)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    H, E = args.hidden_size, args.num_experts
    rope = Rope.from_params(args.rope_parameters, args.head_dim, args.max_position_embeddings, loader.device)

    def route(logits: torch.Tensor):  # [T, E] -> weights, ids [T, A]
        return topk_softmax(logits, args.num_experts_per_tok, out_dtype=logits.dtype)

    def attention(p: str, i: int) -> Attention:
        window = args.sliding_window if args.layer_types[i] == SLIDING else None
        return _attention(loader, p + "self_attn.", args, rope, window)

    return base.build_layers(loader, args, rope, attention, lambda p, i: MoEBlock(
        i, loader.take(p + "mlp.router.weight", (E, H)), route, experts, top_k=args.num_experts_per_tok,
        router_bias=loader.take(p + "mlp.router.bias", (E,))))
