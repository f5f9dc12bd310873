"""MiniMax-M2: every layer sparse, sigmoid router scores with a learned correction bias that steers
only the choice (`block_sparse_moe.e_score_correction_bias`), the top-k uncorrected scores always
renormalized (kept in float32), no shared experts; RMSNorm over the full q and k projections
(before heads are split), partial rotary (`rotary_dim` of each head, or partial_rotary_factor),
experts named w1/w3/w2 under block_sparse_moe as in Mixtral."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope
from moestream.layers.routers import sigmoid_topk
from moestream.models import base

EXPERT_MODULE = "block_sparse_moe"  # model.layers.N.block_sparse_moe.experts.E.w1.weight
EXPERT_NAMES = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
CORRECTION_BIAS = "block_sparse_moe.e_score_correction_bias"


@dataclass
class ModelArgs(base.BaseModelArgs):
    rms_norm_eps: float = 1e-6
    rotary_dim: int | None = None

    @classmethod
    def from_dict(cls, config: dict):
        args = super().from_dict(config)
        # released checkpoints give partial rotary as `rotary_dim` (rotated dimensions of a head)
        if args.rotary_dim and not args.rope_parameters.get("partial_rotary_factor"):
            args.rope_parameters["partial_rotary_factor"] = args.rotary_dim / args.head_dim
        return args


sanitize = base.sanitize  # checkpoint names kept, rotary buffers left out


def quant_predicate(name: str, bits: int | None) -> int | None:
    """The router keeps at least 8 bits (the correction bias is a vector: always float)."""
    return base.router_bits(bits) if name.endswith(".block_sparse_moe.gate.weight") else bits


def route(args: ModelArgs, correction_bias: torch.Tensor, logits: torch.Tensor):
    # the logits in the activations' dtype, scores and weights in float32 (as transformers computes them)
    return sigmoid_topk(logits, args.num_experts_per_tok, correction_bias=correction_bias, normalize=True,
                        out_dtype=torch.float32)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    H, E = args.hidden_size, args.num_experts
    rope = Rope.from_params(args.rope_parameters, args.head_dim, args.max_position_embeddings, loader.device)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="full")
        router = loader.take(p + "block_sparse_moe.gate.weight", (E, H))
        # the choice compares scores that differ in the third decimal: the bias stays float32
        bias = loader.take(p + CORRECTION_BIAS, (E,), dtype=torch.float32)
        ffn = MoEBlock(i, router, partial(route, args, bias), experts, top_k=args.num_experts_per_tok)
        layers.append(base.decoder_layer(loader, p, args, attn, ffn))
    return base.transformer(loader, args, rope, layers)
