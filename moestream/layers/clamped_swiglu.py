"""gpt-oss's expert feed-forward: SwiGLU with biases, a clamped gate and up, sigmoid(alpha·gate)
for silu's sigmoid, and (up + 1) for up."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
                   biases: tuple[torch.Tensor, torch.Tensor, torch.Tensor], alpha: float, limit: float) -> torch.Tensor:
    """x [T, H], gate/up [I, H], down [H, I]; biases (gate [I], up [I], down [H])."""
    g = F.linear(x, gate, biases[0]).clamp(max=limit)
    u = F.linear(x, up, biases[1]).clamp(-limit, limit)
    return F.linear((u + 1) * (g * torch.sigmoid(g * alpha)), down, biases[2])
