"""RMSNorm with the scale applied in float32 before rounding (Gemma 4's norm: a plain `w`, not
`1 + w`), and the scale-free variant Gemma uses on values and router inputs (weight None). On CUDA
one Triton kernel (moestream.kernels.triton_norm)."""
from __future__ import annotations

import torch


def rms_norm_f32(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    if x.is_cuda:
        from moestream.kernels.triton_norm import rms_norm_rows
        return rms_norm_rows(x, weight, eps, "f32")
    x32 = x.to(torch.float32)
    # pow(-0.5), as the reference computes it (rsqrt may round differently)
    x32 = x32 * torch.pow(x32.pow(2).mean(-1, keepdim=True) + eps, -0.5)
    if weight is not None:
        x32 = x32 * weight.to(torch.float32)
    return x32.to(x.dtype)
