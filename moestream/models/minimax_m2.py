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
# the router keeps at least 8 bits (the correction bias is a vector: always float)
quant_predicate = base.routers_keep_8_bits(".block_sparse_moe.gate.weight")


def route(args: ModelArgs, correction_bias: torch.Tensor, logits: torch.Tensor):
    # the logits in the activations' dtype, scores and weights in float32 (as transformers computes them)
    return sigmoid_topk(logits, args.num_experts_per_tok, correction_bias=correction_bias, normalize=True,
                        out_dtype=torch.float32)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> base.MoETransformer:
    rope = Rope.from_params(args.rope_parameters, args.head_dim, args.max_position_embeddings, loader.device)

    def ffn(p: str, i: int) -> MoEBlock:
        # the choice compares scores that differ in the third decimal: the bias stays float32
        bias = loader.take(p + CORRECTION_BIAS, (args.num_experts,), dtype=torch.float32)
        return base.routed_moe(loader, p + "block_sparse_moe.", i, args, partial(route, args, bias), experts)

    return base.build_layers(loader, args, rope, lambda p, i: base.attention(
        loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="full"), ffn)
