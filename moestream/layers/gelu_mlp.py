"""The GELU(tanh)-gated feed-forward: down(gelu_tanh(gate x) * up x) (Gemma's MLPs and experts)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moestream.kernels.reference import rowwise


def gelu_glu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *,
             linear=F.linear) -> torch.Tensor:
    """x [T, H], gate/up [I, H], down [H, I]; linear: the products' kernel."""
    return linear(rowwise(functools.partial(F.gelu, approximate="tanh"), linear(x, gate)) * linear(x, up), down)


class GeluMLP:
    """gate and up are stored as one [2I, H] tensor: on CUDA one product for both, then one kernel for
    the activation (moestream.kernels.triton_sandwich.gelu_glu); elsewhere the products one by one."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor):
        self.gate_up = torch.cat([gate, up])
        self.gate, self.up, self.down = self.gate_up[:gate.shape[0]], self.gate_up[gate.shape[0]:], down

    def __call__(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor:
        if x.is_cuda:
            from moestream.kernels.triton_sandwich import gelu_glu as activation
            return linear(activation(linear(x, self.gate_up)), self.down)
        return gelu_glu(x, self.gate, self.up, self.down, linear=linear)
