"""OLMoE: RMSNorm over the full q and k projections (before heads are split), optional q/k/v clipping."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.models.base import BaseModelArgs, FamilySpec, build_stack


@dataclass
class ModelArgs(BaseModelArgs):
    rms_norm_eps: float = 1e-5
    norm_topk_prob: bool = False
    clip_qkv: float | None = None


def build(args: ModelArgs, loader, provider):
    spec = FamilySpec(qk_norm="full", normalize_topk=args.norm_topk_prob, extra={"clip_qkv": args.clip_qkv})
    return build_stack(args, spec, loader, provider, lambda i: True)
