"""The GELU(tanh)-gated feed-forward: down(gelu_tanh(gate x) * up x) (Gemma's MLPs and experts)."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def gelu_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
             linear=F.linear) -> torch.Tensor:
    """x [T, H], gate/up [I, H], down [H, I]; linear: the products' kernel."""
    return linear(F.gelu(linear(x, gate), approximate="tanh") * linear(x, up), down)


class GeluMLP:
    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor:
        return gelu_glu(x, self.gate, self.up, self.down, linear=linear)
