"""Qwen3-MoE: per-head q/k RMSNorm, softmax top-k routing with optional renormalization, no shared expert."""
from __future__ import annotations

from dataclasses import dataclass, field

from moestream.models.base import BaseModelArgs, FamilySpec, build_stack


@dataclass
class ModelArgs(BaseModelArgs):
    moe_intermediate_size: int = 768
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


def build(args: ModelArgs, loader, provider):
    spec = FamilySpec(qk_norm="head", normalize_topk=args.norm_topk_prob)
    return build_stack(args, spec, loader, provider, args.is_moe_layer)
