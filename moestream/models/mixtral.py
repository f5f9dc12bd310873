"""Mixtral: every layer sparse, top-k weights always renormalized (kept in float32), experts w1/w3/w2."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.models.base import BaseModelArgs, FamilySpec, build_stack


@dataclass
class ModelArgs(BaseModelArgs):
    rms_norm_eps: float = 1e-5


def build(args: ModelArgs, loader, provider):
    spec = FamilySpec(moe_prefix="block_sparse_moe", normalize_topk=True, float32_routing_weights=True)
    return build_stack(args, spec, loader, provider, lambda i: True)
