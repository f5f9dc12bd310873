"""Rotary position embedding: the default kind, and YaRN's frequencies and scales for the families
that declare it (the others refuse any scaling at load)."""
from __future__ import annotations

import math

import torch

from moestream.errors import UnsupportedModelError


def rope_scaling(config: dict) -> dict:
    """The rope parameters with their kind under "rope_type": transformers 5's `rope_parameters`,
    or transformers 4's `rope_scaling` (which spelled the kind "type")."""
    params = dict(config.get("rope_scaling") or config.get("rope_parameters") or {})
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def rope_theta(config: dict, *, supported: tuple[str, ...] = ("default",)) -> float:
    """`rope_theta` (transformers 4) or `rope_parameters.rope_theta` (transformers 5); a rope kind
    outside `supported` (the family's) is refused."""
    kind = rope_scaling(config)["rope_type"]
    if kind not in supported:
        raise UnsupportedModelError(f"rope type {kind!r} is not supported for this family (supported: "
                                    f"{', '.join(supported)})")
    params = config.get("rope_parameters") or {}
    theta = config.get("rope_theta", params.get("rope_theta"))
    return float(theta if theta is not None else 10000.0)


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    # YaRN's attention temperature: 0.1 * m * ln(s) + 1 for a stretch s > 1
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_factor(params: dict, max_position_embeddings: int) -> float:
    factor = params.get("factor")
    if factor is None:  # the stretch implied by the context lengths
        factor = max_position_embeddings / params["original_max_position_embeddings"]
    return float(factor)


def yarn_inv_freq_and_scale(config: dict, dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN (arXiv 2309.00071) for `dim` rotary dimensions: the inverse frequencies [dim/2] (high
    frequencies kept, low ones divided by the stretch factor, a linear ramp between the dimensions
    that turn beta_fast and beta_slow times over the original context) and the factor that scales
    cos and sin (given as attention_factor, else from mscale / mscale_all_dim)."""
    params = rope_scaling(config)
    if "original_max_position_embeddings" not in params:
        raise UnsupportedModelError("yarn rope parameters lack original_max_position_embeddings")
    original = params["original_max_position_embeddings"]
    factor = _yarn_factor(params, config.get("max_position_embeddings", original))
    scale = params.get("attention_factor")
    if scale is None:
        mscale, mscale_all = params.get("mscale"), params.get("mscale_all_dim")
        scale = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) if mscale and mscale_all
                 else _yarn_mscale(factor))
    beta_fast, beta_slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dimension_turning(turns: float) -> float:  # the dimension whose wavelength fits `turns` times
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_turning(beta_fast), dimension_turning(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    keep = 1 - ramp  # 1: the original frequency (fast dimensions), 0: stretched by `factor`
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, float(scale)


def yarn_softmax_scale(config: dict) -> float:
    """DeepSeek's extra softmax temperature under YaRN: mscale(factor, mscale_all_dim)², 1 without
    YaRN or without mscale_all_dim."""
    params = rope_scaling(config)
    if params["rope_type"] == "default" or not params.get("mscale_all_dim"):
        return 1.0
    return _yarn_mscale(_yarn_factor(params, config.get("max_position_embeddings", 0)), params["mscale_all_dim"]) ** 2


class Rope:
    """cos/sin tables of rotary dimension `head_dim`; `inv_freq` replaces the default frequencies
    (YaRN) and `attention_factor` scales cos and sin, as transformers does."""

    def __init__(self, head_dim: int, theta: float, device: torch.device, *, inv_freq: torch.Tensor | None = None,
                 attention_factor: float = 1.0):
        if inv_freq is None:  # computed on `device`, as it always was (the same bits there)
            inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device=device).float() / head_dim))
        self.inv_freq = inv_freq.to(device)
        self.attention_factor = attention_factor

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, D] in `dtype` (computed in float32)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, D] (heads first), cos/sin [T, D]."""
    return x * cos + rotate_half(x) * sin


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), x [N, T, D], cos/sin [T, D] as
    cos_sin gives them. The result lists the pairs' first members, then their second members:
    applied to queries and keys alike, the permutation leaves every dot product unchanged."""
    cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
