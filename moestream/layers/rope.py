"""Rotary position embedding (the default, unscaled kind; other scalings are refused at load)."""
from __future__ import annotations

import torch

from moestream.errors import UnsupportedModelError


def rope_theta(config: dict) -> float:
    """`rope_theta` (transformers 4) or `rope_parameters.rope_theta` (transformers 5)."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or params
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind not in ("default", None):
        raise UnsupportedModelError(f"rope type {kind!r} is not supported yet (only the default rotary embedding)")
    theta = config.get("rope_theta", params.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


class Rope:
    def __init__(self, head_dim: int, theta: float, device: torch.device):
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] in `dtype` (computed in float32)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, D] (heads first), cos/sin [T, D]."""
    return x * cos + rotate_half(x) * sin
