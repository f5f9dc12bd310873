"""OLMoE: RMSNorm over the full q and k projections (before heads are split), optional q/k/v
clipping, every layer sparse, softmax top-k routing."""
from __future__ import annotations

from dataclasses import dataclass
from functools import partial

from moestream.layers.experts import RoutedExperts
from moestream.layers.moe import MoEBlock
from moestream.layers.rope import Rope
from moestream.layers.routers import softmax_topk
from moestream.layers.transformer import DecoderLayer, MoETransformer
from moestream.models import base

EXPERT_MODULE = "mlp"
EXPERT_NAMES = {p: p for p in base.EXPERT_PROJECTIONS}


@dataclass
class ModelArgs(base.BaseModelArgs):
    rms_norm_eps: float = 1e-5
    norm_topk_prob: bool = False
    clip_qkv: float | None = None


def sanitize(name: str) -> str | None:
    return None if name.endswith("rotary_emb.inv_freq") else name


def quant_predicate(name: str, bits: int | None) -> int | None:
    return base.router_bits(bits) if name.endswith(".mlp.gate.weight") else bits


def route(args: ModelArgs, logits):
    return softmax_topk(logits, args.num_experts_per_tok, normalize=args.norm_topk_prob, out_dtype=logits.dtype)


def build(args: ModelArgs, loader, experts: RoutedExperts) -> MoETransformer:
    H = args.hidden_size
    rope = Rope(args.head_dim, args.rope_theta, loader.device)
    layers = []
    for i in range(args.num_hidden_layers):
        p = f"model.layers.{i}."
        attn = base.attention(loader, p + "self_attn.", args, rope, bias=args.attention_bias, qk_norm="full",
                              clip_qkv=args.clip_qkv)
        router = loader.take(p + "mlp.gate.weight", (args.num_experts, H))
        ffn = MoEBlock(i, router, partial(route, args), experts, top_k=args.num_experts_per_tok)
        layers.append(DecoderLayer(attn, ffn, *base.norms(loader, p, H), args.rms_norm_eps))
    embed, final_norm, lm_head = base.embeddings(loader, args)
    return MoETransformer(embed=embed, layers=layers, final_norm=final_norm, lm_head=lm_head, rope=rope,
                          eps=args.rms_norm_eps)
