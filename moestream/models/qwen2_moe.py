"""Qwen2-MoE: q/k/v biases, a shared expert behind a sigmoid gate, dense layers by sparse step."""
from __future__ import annotations

from dataclasses import dataclass, field

from moestream.models.base import BaseModelArgs, FamilySpec, build_stack


@dataclass
class ModelArgs(BaseModelArgs):
    moe_intermediate_size: int = 1408
    shared_expert_intermediate_size: int = 5632
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    qkv_bias: bool = True  # transformers 4 always had q/k/v biases

    def is_moe_layer(self, i: int) -> bool:
        return i not in self.mlp_only_layers and self.num_experts > 0 and (i + 1) % self.decoder_sparse_step == 0


def build(args: ModelArgs, loader, provider):
    args.attention_bias = args.qkv_bias
    spec = FamilySpec(normalize_topk=args.norm_topk_prob, shared_expert=True)
    return build_stack(args, spec, loader, provider, args.is_moe_layer)
