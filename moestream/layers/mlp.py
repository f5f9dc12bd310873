"""The SwiGLU feed-forward used by dense layers and shared experts: down(silu(gate x) * up x)."""
from __future__ import annotations

import torch

from moestream.kernels.reference import swiglu  # noqa: F401 (the layers' name for it)


class DenseMLP:
    """A dense layer's feed-forward (layers the config keeps out of the MoE)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate, self.up, self.down = gate, up, down

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        y = swiglu(x, self.gate, self.up, self.down)
        return y if residual is None else residual + y
