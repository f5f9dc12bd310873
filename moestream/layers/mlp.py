"""The SwiGLU feed-forward used by dense layers and shared experts: down(silu(gate x) * up x)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    # x [T, H]; gate/up [I, H]; down [H, I]
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


class DenseMLP:
    """A dense layer's feed-forward (layers the config keeps out of the MoE)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = swiglu(x, self.gate, self.up, self.down)
        return y if residual is None else residual + y
