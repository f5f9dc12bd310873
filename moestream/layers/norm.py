"""RMSNorm as transformers computes it: statistics in float32, scale applied in the input dtype
(on CUDA one Triton kernel with the same roundings: moestream.kernels.triton_norm)."""
from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from moestream.kernels.triton_norm import rms_norm_rows
        return rms_norm_rows(x, weight, eps, "round")
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)
