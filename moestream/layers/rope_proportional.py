"""Rotary variants read per layer type: the default kind, and "proportional" (partial rotary whose
frequencies keep the full head size in their exponent; the unrotated pairs get frequency 0, i.e.
cos 1 and sin 0, so the vector keeps its head size)."""
from __future__ import annotations

import torch

from moestream.errors import UnsupportedModelError
from moestream.layers.rope import Rope


class TableRope(Rope):
    """A Rope from a given inverse-frequency table [D/2]."""

    def __init__(self, inv_freq: torch.Tensor):
        head_dim = 2 * inv_freq.shape[0]
        super().__init__(head_dim, 1.0, inv_freq.device, inv_freq=inv_freq)


def rope_for(params: dict, head_dim: int, device: torch.device) -> Rope:
    """The rotary embedding a layer type's `rope_parameters` entry describes."""
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10000.0))
    if kind == "default":
        return Rope(head_dim, theta, device)
    if kind != "proportional":
        raise UnsupportedModelError(f"rope type {kind!r} is not supported for this family (default or proportional)")
    angles = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
    exponents = torch.arange(0, 2 * angles, 2, dtype=torch.int64, device=device).float() / head_dim
    rotated = 1.0 / (theta ** exponents)
    zeros = torch.zeros(head_dim // 2 - angles, dtype=torch.float32, device=device)
    return TableRope(torch.cat([rotated, zeros]) / float(params.get("factor", 1.0)))
