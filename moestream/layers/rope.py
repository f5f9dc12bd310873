"""Rotary position embedding: the default kind, partial rotary (only the first part of each head
rotates) and YaRN (frequencies blended between interpolation and extrapolation, cos/sin scaled)."""
from __future__ import annotations

import math

import torch

from moestream.errors import UnsupportedModelError


def rope_parameters(config: dict) -> dict:
    """The rotary settings of a config.json in one dict: transformers 5's `rope_parameters`, or
    transformers 4's `rope_theta` / `rope_scaling` / `partial_rotary_factor` at the top level."""
    params = dict(config.get("rope_scaling") or {})
    params.update(config.get("rope_parameters") or {})
    for key in ("rope_theta", "partial_rotary_factor"):
        if params.get(key) is None and config.get(key) is not None:
            params[key] = config[key]
    params["rope_type"] = params.get("rope_type", params.get("type")) or "default"
    return params


def rope_theta(config: dict, *, supported: tuple[str, ...] = ("default",)) -> float:
    """`rope_theta` (transformers 4) or `rope_parameters.rope_theta` (transformers 5); refuses a
    rope type the family does not compute."""
    params = rope_parameters(config)
    if params["rope_type"] not in supported:
        raise UnsupportedModelError(f"rope type {params['rope_type']!r} is not supported for this model "
                                    f"(supported: {', '.join(supported)})")
    theta = params.get("rope_theta")
    return float(theta if theta is not None else 10000.0)


def _yarn_mscale(factor: float, m: float = 1.0) -> float:
    # YaRN's attention temperature: 0.1 * m * ln(s) + 1 for a stretch s > 1
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def _yarn(theta: float, dim: int, params: dict, max_positions: int) -> tuple[torch.Tensor, float]:
    """YaRN: (inverse frequencies [dim/2], the factor cos and sin are scaled by)."""
    original = params.get("original_max_position_embeddings") or max_positions
    factor = params.get("factor")
    if factor is None:  # DeepSeek-style configs give only the two lengths
        factor = max_positions / original

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all) if m and m_all else _yarn_mscale(factor)
    fast, slow = params.get("beta_fast") or 32, params.get("beta_slow") or 1

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times over the original length
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(fast), dim_for(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    # high-frequency dimensions keep their frequency, low-frequency ones are interpolated by `factor`
    keep = 1 - ramp
    inv_freq = (1.0 / (factor * base)) * (1 - keep) + (1.0 / base) * keep
    return inv_freq, float(attention)


class Rope:
    """cos/sin tables for positions. rotary_dim < head_dim rotates only the first rotary_dim of each
    head (partial rotary); `scale` multiplies cos and sin (YaRN's attention factor)."""

    def __init__(self, head_dim: int, theta: float, device: torch.device, *, rotary_dim: int | None = None,
                 inv_freq: torch.Tensor | None = None, scale: float = 1.0):
        dim = head_dim if rotary_dim is None else rotary_dim
        if inv_freq is None:
            inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)
        self.head_dim, self.rotary_dim, self.scale = head_dim, dim, float(scale)

    @classmethod
    def from_params(cls, params: dict, head_dim: int, max_positions: int, device: torch.device) -> "Rope":
        """The rotary embedding of `rope_parameters(config)` (default or yarn, partial_rotary_factor)."""
        kind = params.get("rope_type", "default")
        if kind not in ("default", "yarn"):
            raise UnsupportedModelError(f"rope type {kind!r} is not supported (supported: default, yarn)")
        theta = float(params.get("rope_theta") or 10000.0)
        dim = int(head_dim * float(params.get("partial_rotary_factor") or 1.0))
        if dim % 2 or dim <= 0:
            raise UnsupportedModelError(f"partial_rotary_factor gives {dim} rotary dimensions of {head_dim} (needs an even number)")
        if kind == "yarn":
            inv_freq, scale = _yarn(theta, dim, params, max_positions)
            return cls(head_dim, theta, device, rotary_dim=dim, inv_freq=inv_freq, scale=scale)
        return cls(head_dim, theta, device, rotary_dim=dim)

    @property
    def plain(self) -> bool:
        """Full-width and unscaled: what the fused CUDA decode kernel computes."""
        return self.rotary_dim == self.head_dim and self.scale == 1.0

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim] in `dtype` (computed in float32)."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        if self.scale != 1.0:
            cos, sin = cos * self.scale, sin * self.scale
        return cos.to(dtype), sin.to(dtype)

    def rows_cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim] of positions [T] (CPU), each row as `cos_sin` gives its position
        alone (a vectorized cos may round a vector's tail otherwise). The last answer is kept: every
        layer of a step or prefill chunk asks for the same."""
        key = (tuple(positions.tolist()), dtype)
        if getattr(self, "_rows_key", None) != key:
            rows = [self.cos_sin(positions[t:t + 1], dtype) for t in range(positions.shape[0])]
            self._rows = torch.cat([c for c, _ in rows]), torch.cat([s for _, s in rows])
            self._rows_key = key
        return self._rows


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, T, D] (heads first), cos/sin [T, R]: the first R of D rotate, the rest pass through."""
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    rot = x[..., :r]
    return torch.cat((rot * cos + rotate_half(rot) * sin, x[..., r:]), dim=-1)


def yarn_inv_freq_and_scale(config: dict, dim: int, theta: float) -> tuple[torch.Tensor, float]:
    """YaRN for `dim` rotary dimensions of a config.json: (inverse frequencies [dim/2], the factor
    cos and sin are scaled by)."""
    params = rope_parameters(config)
    if "original_max_position_embeddings" not in params:
        raise UnsupportedModelError("yarn rope parameters lack original_max_position_embeddings")
    return _yarn(theta, dim, params, config.get("max_position_embeddings", params["original_max_position_embeddings"]))


def yarn_softmax_scale(config: dict) -> float:
    """DeepSeek's extra softmax temperature under YaRN: mscale(factor, mscale_all_dim)², 1 without
    YaRN or without mscale_all_dim."""
    params = rope_parameters(config)
    if params["rope_type"] == "default" or not params.get("mscale_all_dim"):
        return 1.0
    factor = params.get("factor")
    if factor is None:
        factor = config.get("max_position_embeddings", 0) / params["original_max_position_embeddings"]
    return _yarn_mscale(float(factor), params["mscale_all_dim"]) ** 2


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on pairs (x0, x1), (x2, x3), ... (DeepSeek's layout), x [N, T, D], cos/sin [T, D] as
    cos_sin gives them. The result lists the pairs' first members, then their second members:
    applied to queries and keys alike, the permutation leaves every dot product unchanged."""
    cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)
