"""Fused Triton RMSNorm kernels for a decode step (one token, or T rows at once).

Why: on the GPU a decode step is bound by kernel launches, not by arithmetic. In torch, RMSNorm
alone is eight kernels (to(float32), pow, mean, add, rsqrt, mul, to(dtype), mul). These do it in one:

  rms_norm          1 launch   y = rms_norm(x)                          x [T, N]
  add_rms_norm      1 launch   h = x + y, hn = rms_norm(h)              (the residual add; optionally
                               hn in float32 too, in the expert gemv kernels' input order)

Both can be captured in a CUDA graph: no host syncs and no shape or allocation depends on a device
value. Row t is computed by the same arithmetic as alone, so its bits never depend on the rows beside it.

Exactness contract (activations bf16/fp16/fp32, weights in the activation dtype): rms_norm /
add_rms_norm compute what moestream.layers.norm.rms_norm does, op by op: statistics in float32
(mean of squares as sum * (1/N), + eps, rsqrt), x32 * rstd rounded to the dtype, then times the
weight rounded to the dtype. Only the float32 summation order differs from torch: it can move rstd
by an ulp, which rarely moves a bf16/fp16 result by an ulp (two after the weight multiply); inputs
whose sum of squares is exact in float32 give torch's bits. The kernels are compiled with
enable_fp_fusion=False: a fused multiply-add would skip a rounding torch does.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.expert_layout import ACT_DTYPES
from moestream.kernels.pdl import pdl_launch

MAX_N = 16384  # rms_norm keeps one whole row in registers


# -- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _rms_scale(x32, w, eps, inv_n, DTYPE: tl.constexpr):
    """rms_norm of one float32 row (zeros past the end) with weight w, in torch's order of roundings."""
    rstd = tl.math.rsqrt(tl.sum(x32 * x32, axis=0) * inv_n + eps)
    y = (x32 * rstd).to(DTYPE)
    return (w.to(tl.float32) * y.to(tl.float32)).to(DTYPE)


@triton.jit
def _rms_norm_kernel(x_ptr, stride_x, w_ptr, out_ptr, stride_o, N, eps, inv_n, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, _rms_scale(x, w, eps, inv_n, out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _add_rms_norm_kernel(x_ptr, stride_x, y_ptr, stride_y, w_ptr, h_ptr, hn_ptr, split_ptr, N, eps, inv_n,
                         BLOCK: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # SPLIT > 0: hn also in float32 at split_ptr [T, SPLIT, N/SPLIT], element n at [n % SPLIT, n // SPLIT]
    DTYPE: tl.constexpr = h_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(y_ptr + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
    h = (x + y).to(DTYPE)  # float32 add, then one rounding, as torch adds two bf16 tensors
    tl.store(h_ptr + row * N + cols, h, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    hn = _rms_scale(h.to(tl.float32), w, eps, inv_n, DTYPE)
    tl.store(hn_ptr + row * N + cols, hn, mask=mask)
    if SPLIT > 0:
        tl.store(split_ptr + row * N + (cols % SPLIT) * (N // SPLIT) + cols // SPLIT, hn.to(tl.float32), mask=mask)


_INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)  # under Triton's CPU interpreter (tests)


# -- wrappers ------------------------------------------------------------------------------------------

def _check_act(name: str, t: torch.Tensor) -> None:
    if t.dtype not in ACT_DTYPES:
        raise ValueError(f"{name}: dtype {t.dtype} (kernels handle bf16, fp16, fp32)")
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: the last dimension must be contiguous")


def _inv(n: int) -> float:
    """float32(1) / float32(n), the factor torch's CUDA mean multiplies the sum by (host arithmetic)."""
    return (torch.ones((), dtype=torch.float32) / n).item()


def _row_setup(x: torch.Tensor, weight: torch.Tensor) -> tuple[int, int, int, int]:
    _check_act("x", x)
    if x.dim() != 2:
        raise ValueError(f"x: shape {list(x.shape)}, expected [T, N]")
    T, N = x.shape
    if weight.shape != (N,) or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight: {weight.dtype} {list(weight.shape)}, expected contiguous {x.dtype} [{N}]")
    if N > MAX_N:
        raise ValueError(f"rows of {N} elements (the kernels handle up to {MAX_N})")
    block = triton.next_power_of_2(N)
    return T, N, block, min(16, max(1, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """moestream.layers.norm.rms_norm of x [T, N] (rows may be strided); one program per row."""
    T, N, block, warps = _row_setup(x, weight)
    out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    if T:
        _rms_norm_kernel[(T,)](x, x.stride(0), weight, out, out.stride(0), N, eps, _inv(N), BLOCK=block,
                               num_warps=warps, enable_fp_fusion=False, **pdl_launch(x, _INTERPRETED))
    return out


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float, *,
                 split: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(h, rms_norm(h)) with h = x + y in x's dtype: a residual add and the next norm in one kernel.
    split: a contiguous float32 [T, C, N/C] tensor that also takes rms_norm(h) in float32, element n
    of a row at [n % C, n // C] (the input order of the gemv expert kernels, moestream.kernels.triton_moe):
    the expert input written here rather than by a copy kernel of its own."""
    T, N, block, warps = _row_setup(x, weight)
    _check_act("y", y)
    if y.shape != x.shape or y.dtype != x.dtype:
        raise ValueError(f"y: {y.dtype} {list(y.shape)}, expected {x.dtype} {list(x.shape)}")
    if split is not None and (split.dim() != 3 or split.shape[0] != T or split.shape[1] * split.shape[2] != N
                              or split.dtype != torch.float32 or not split.is_contiguous()):
        raise ValueError(f"split: {split.dtype} {list(split.shape)}, expected contiguous float32 [{T}, C, {N}/C]")
    h = torch.empty((T, N), dtype=x.dtype, device=x.device)
    hn = torch.empty_like(h)
    if T:
        _add_rms_norm_kernel[(T,)](x, x.stride(0), y, y.stride(0), weight, h, hn, hn if split is None else split,
                                   N, eps, _inv(N), BLOCK=block, SPLIT=0 if split is None else split.shape[1],
                                   num_warps=warps, enable_fp_fusion=False, **pdl_launch(x, _INTERPRETED))
    return h, hn
