"""Gemma 4's sandwich norms around the feed-forward half, each side one Triton kernel, and its dense
MLP's activation on the gate and up products computed as one.

In torch a decode step's MoE layer takes ~20 kernels between attention and experts and back: the
post-attention norm and residual add, three norms of h (the dense MLP's, the experts', the router's
scale-free one times its scale and H^-1/2), then after the experts two post norms, a sum, the outer
norm, the residual add and the layer scalar. Here:

  tail     h = x + norm(a) * w_post;  h's three norms        (moestream.layers.sandwich.sandwich_tail)
  combine  (h + norm(norm(d) * w1 + norm(r) * w2) * w) * s    (moestream.layers.sandwich.sandwich_combine)

One program per row holds the whole vector, so a row's bits never depend on the rows beside it. The
roundings are those of the torch functions (rms_norm_f32: statistics and scale in float32, rounded
to the dtype; adds and products rounded as torch rounds them); sums may add in another order."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.triton_norm import _normed

F32 = tl.constexpr(1)  # triton_norm's "f32" kind: round(x / rms * w)


@triton.jit
def _inv_rms(x, N, eps):
    return 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / N + eps)


@triton.jit
def _tail(x_ptr, a_ptr, w_post_ptr, w_mlp_ptr, w_exp_ptr, w_route_ptr, h_ptr, mlp_ptr, exp_ptr, route_ptr,
          N, eps, route_scale, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    DT = h_ptr.dtype.element_ty
    a = tl.load(a_ptr + row + cols, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_post_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    x = tl.load(x_ptr + row + cols, mask=keep, other=0.0).to(tl.float32)
    h = (x + _normed(a, w, _inv_rms(a, N, eps), F32, DT, DT)).to(DT).to(tl.float32)
    tl.store(h_ptr + row + cols, h.to(DT), mask=keep)
    r = _inv_rms(h, N, eps)
    w = tl.load(w_mlp_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(mlp_ptr + row + cols, _normed(h, w, r, F32, DT, DT).to(DT), mask=keep)
    w = tl.load(w_exp_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    tl.store(exp_ptr + row + cols, _normed(h, w, r, F32, DT, DT).to(DT), mask=keep)
    # the router's input: the scale-free norm, times its scale, times H^-1/2, each product rounded
    w = tl.load(w_route_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    z = ((h * r).to(DT).to(tl.float32) * w).to(DT).to(tl.float32) * route_scale
    tl.store(route_ptr + row + cols, z.to(DT), mask=keep)


def sandwich_tail(x: torch.Tensor, a: torch.Tensor, w_post: torch.Tensor, w_mlp: torch.Tensor, w_experts: torch.Tensor,
                  w_route: torch.Tensor, eps: float, route_scale: float) -> tuple[torch.Tensor, ...]:
    """x, a [R, H] (the residual and attention's output, one dtype, contiguous) -> h, the dense MLP's
    input, the experts' input, the router's input, each [R, H] in x's dtype."""
    R, N = x.shape
    outs = tuple(torch.empty_like(x) for _ in range(4))
    if R:
        _tail[(R,)](x, a, w_post, w_mlp, w_experts, w_route, *outs, N, eps, route_scale,
                    BLOCK=triton.next_power_of_2(N), enable_fp_fusion=False)
    return outs


@triton.jit
def _combine(r_ptr, d_ptr, res_ptr, w_r_ptr, w_d_ptr, w_ptr, s_ptr, out_ptr, N, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64) * N
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    DT = out_ptr.dtype.element_ty
    d = tl.load(d_ptr + row + cols, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_d_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    d = _normed(d, w, _inv_rms(d, N, eps), F32, DT, DT)
    r = tl.load(r_ptr + row + cols, mask=keep, other=0.0).to(tl.float32)
    w = tl.load(w_r_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    y = (d + _normed(r, w, _inv_rms(r, N, eps), F32, DT, DT)).to(DT).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    y = _normed(y, w, _inv_rms(y, N, eps), F32, DT, DT)
    res = tl.load(res_ptr + row + cols, mask=keep, other=0.0).to(tl.float32)
    y = (res + y).to(DT).to(tl.float32) * tl.load(s_ptr).to(tl.float32)
    tl.store(out_ptr + row + cols, y.to(DT), mask=keep)


def sandwich_combine(routed: torch.Tensor, dense: torch.Tensor, residual: torch.Tensor, w_routed: torch.Tensor,
                     w_dense: torch.Tensor, w_out: torch.Tensor, scalar: torch.Tensor, eps: float) -> torch.Tensor:
    """routed, dense, residual [R, H] (one dtype, contiguous), scalar [1] -> the layer's output [R, H]."""
    R, N = residual.shape
    out = torch.empty_like(residual)
    if R:
        _combine[(R,)](routed, dense, residual, w_routed, w_dense, w_out, scalar, out, N, eps,
                       BLOCK=triton.next_power_of_2(N), enable_fp_fusion=False)
    return out


_INTERPRETED = isinstance(_tail, InterpretedFunction)  # Triton's CPU interpreter (the tests' stage)


@triton.jit
def _gelu_glu(y_ptr, out_ptr, I, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    # y [R, 2I] = [gate | up] (one product) -> gelu_tanh(gate) * up [R, I], each rounded as torch rounds
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < I
    DT = out_ptr.dtype.element_ty
    g = tl.load(y_ptr + row * 2 * I + cols, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(y_ptr + row * 2 * I + I + cols, mask=keep, other=0.0).to(tl.float32)
    inner = 0.7978845608028654 * (g + 0.044715 * (g * g * g))
    if LIBDEVICE:  # tanh as torch's CUDA gelu takes it
        t = libdevice.tanh(inner)
    else:  # (the CPU interpreter has no libdevice)
        t = 1.0 - 2.0 / (tl.exp(2.0 * inner) + 1.0)
    a = (0.5 * g * (1.0 + t)).to(DT).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (a * u).to(DT), mask=keep)


def gelu_glu(y: torch.Tensor) -> torch.Tensor:
    """y [R, 2I] (the gate and up products side by side, contiguous) -> gelu_tanh(gate) * up [R, I]."""
    R, I = y.shape[0], y.shape[1] // 2
    out = torch.empty((R, I), dtype=y.dtype, device=y.device)
    if R:
        _gelu_glu[(R, triton.cdiv(I, 1024))](y, out, I, BLOCK=1024, LIBDEVICE=not _INTERPRETED,
                                                  enable_fp_fusion=False)
    return out
