"""RMSNorm rows, and the per-head q/k norm with the rotary embedding, each one Triton kernel.

In torch an RMSNorm is six kernels (cast, square, mean, add, rsqrt, scale) and a rotary embedding
about ten (cos/sin tables, halves, products, concatenation); a decode step of Gemma 4 ran ~330
norms a token this way. Here one program per row (per row and head for the rotary one) holds the
whole vector, so a row's bits never depend on the rows beside it or on how many there are. The
roundings follow the torch functions they stand for (moestream.layers.norm / norm_f32, apply_rope):
statistics in float32, rounded to the input's dtype where torch rounds (no fused multiply-adds:
one would skip a rounding torch does; sums may still add in another order).

Norm kinds:
  "round"  weight * round(x / rms)        (rms_norm: the scale applied in the input dtype)
  "f32"    round(x / rms * weight)        (rms_norm_f32, offset_rms_norm: the scale in float32)
  "plain"  round(x / rms)                 (the scale-free norm)"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

KINDS = {"round": 0, "f32": 1, "plain": 2}


@triton.jit
def _normed(x, w, r, KIND: tl.constexpr, XT: tl.constexpr, DT: tl.constexpr):
    """x [BLOCK] float32 (holding XT values), its weights w (float32), 1/rms r -> the normed row,
    float32 holding DT values (the output's dtype)."""
    y = x * r
    if KIND == 0:
        y = y.to(XT).to(tl.float32) * w
    elif KIND == 1:
        y = y * w
    return y.to(DT).to(tl.float32)


@triton.jit
def _rms_rows(x_ptr, s0, s1, w_ptr, out_ptr, B, N, eps, KIND: tl.constexpr, BLOCK: tl.constexpr):
    a, b = tl.program_id(0), tl.program_id(1)
    cols = tl.arange(0, BLOCK)
    keep = cols < N
    x = tl.load(x_ptr + a.to(tl.int64) * s0 + b.to(tl.int64) * s1 + cols, mask=keep, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / N + eps)
    w = x
    if KIND != 2:
        w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
    y = _normed(x, w, r, KIND, x_ptr.dtype.element_ty, out_ptr.dtype.element_ty)
    tl.store(out_ptr + (a.to(tl.int64) * B + b) * N + cols, y.to(out_ptr.dtype.element_ty), mask=keep)


def rms_norm_rows(x: torch.Tensor, weight: torch.Tensor | None, eps: float, kind: str) -> torch.Tensor:
    """RMSNorm over x's last dimension (contiguous; any strides before it) -> a new contiguous tensor
    of x's shape; "round" gives torch's result dtype of weight and x, the others x's dtype."""
    if weight is None:
        kind = "plain"
    shape, N = x.shape, x.shape[-1]
    if x.stride(-1) != 1:
        x = x.contiguous()
    x3 = x.reshape(-1, 1, N) if x.dim() != 3 else x  # (a view where x's strides allow it)
    dtype = torch.result_type(weight, x) if kind == "round" else x.dtype
    out = torch.empty(shape, dtype=dtype, device=x.device)
    if out.numel():
        A, B = x3.shape[0], x3.shape[1]
        _rms_rows[(A, B)](x3, x3.stride(0), x3.stride(1), weight if weight is not None else x3, out, B, N, eps,
                          KIND=KINDS[kind], BLOCK=triton.next_power_of_2(N), enable_fp_fusion=False)
    return out


@triton.jit
def _norm_rope_row(t, h, x_ptr, s0, s1, w_ptr, pos_ptr, freq_ptr, out_ptr, N, D, R, eps, scale,
                   KIND: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Token t's head h of x [T, N, D] (strides s0, s1) normed and rotated into out [T, N, D]."""
    cols = tl.arange(0, BLOCK)
    keep = cols < D
    half = R // 2
    rotated = cols < R
    partner = tl.where(cols < half, cols + half, tl.where(rotated, cols - half, cols))
    row = x_ptr + t.to(tl.int64) * s0 + h.to(tl.int64) * s1
    x = tl.load(row + cols, mask=keep, other=0.0).to(tl.float32)
    xp = tl.load(row + partner, mask=keep, other=0.0).to(tl.float32)
    DT = out_ptr.dtype.element_ty
    if NORM:
        r = 1.0 / tl.sqrt_rn(tl.sum(x * x, 0) / D + eps)
        w, wp = x, xp
        if KIND != 2:
            w = tl.load(w_ptr + cols, mask=keep, other=0.0).to(tl.float32)
            wp = tl.load(w_ptr + partner, mask=keep, other=0.0).to(tl.float32)
        x, xp = _normed(x, w, r, KIND, DT, DT), _normed(xp, wp, r, KIND, DT, DT)
    # cos and sin as Rope.cos_sin gives them: float32 angle, times the scale, rounded to the dtype
    f = tl.load(freq_ptr + tl.where(cols < half, cols, cols - half), mask=rotated, other=0.0)
    angle = tl.load(pos_ptr + t).to(tl.float32) * f
    if LIBDEVICE:  # correctly reduced for large angles, as torch's cosf/sinf
        c, s = libdevice.cos(angle), libdevice.sin(angle)
    else:  # (the CPU interpreter has no libdevice)
        c, s = tl.cos(angle), tl.sin(angle)
    cos = (c * scale).to(DT).to(tl.float32)
    sin = (s * scale).to(DT).to(tl.float32)
    turned = tl.where(cols < half, -xp, xp)  # rotate_half
    y = (x * cos).to(DT).to(tl.float32) + (turned * sin).to(DT).to(tl.float32)
    y = tl.where(rotated, y, x)
    tl.store(out_ptr + (t.to(tl.int64) * N + h) * D + cols, y.to(DT), mask=keep)


@triton.jit
def _norm_rope(a_ptr, a0, a1, wa_ptr, out_a_ptr, NA, b_ptr, b0, b1, wb_ptr, out_b_ptr, NB, pos_ptr, freq_ptr, D, R,
               eps, scale, KIND: tl.constexpr, NORM: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    # one program per token and head of a (queries), then of b (keys): both in one launch
    t, h = tl.program_id(0), tl.program_id(1)
    if h < NA:
        _norm_rope_row(t, h, a_ptr, a0, a1, wa_ptr, pos_ptr, freq_ptr, out_a_ptr, NA, D, R, eps, scale, KIND, NORM,
                       BLOCK, LIBDEVICE)
    else:
        _norm_rope_row(t, h - NA, b_ptr, b0, b1, wb_ptr, pos_ptr, freq_ptr, out_b_ptr, NB, D, R, eps, scale, KIND,
                       NORM, BLOCK, LIBDEVICE)


def norm_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scale: float, *,
              weight: torch.Tensor | None = None, eps: float = 0.0, kind: str | None = None,
              other: torch.Tensor | None = None, other_weight: torch.Tensor | None = None):
    """x [T, N, D] (last dimension contiguous) -> [T, N, D] contiguous: each head's vector RMSNormed
    over D (kind as above; None: no norm), then its first 2 * len(inv_freq) dimensions rotated
    (rotate-half) at positions [T] -- apply_rope(norm(x)) as one kernel. With `other` [T, N2, D] (the
    keys beside the queries, normed with other_weight) both in the same launch: (x's, other's)."""
    T, N, D = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    y = x if other is None else (other if other.stride(-1) == 1 else other.contiguous())
    out = torch.empty((T, N, D), dtype=x.dtype, device=x.device)
    out_y = out if other is None else torch.empty(y.shape, dtype=y.dtype, device=y.device)
    NB = 0 if other is None else y.shape[1]
    if T:
        norm = kind is not None
        kind = "plain" if norm and weight is None else kind
        w = weight if weight is not None else x
        wy = other_weight if other_weight is not None else w
        _norm_rope[(T, N + NB)](x, x.stride(0), x.stride(1), w, out, N, y, y.stride(0), y.stride(1), wy, out_y, NB,
                                positions, inv_freq, D, 2 * inv_freq.shape[0], eps, scale, KIND=KINDS.get(kind, 2),
                                NORM=norm, BLOCK=triton.next_power_of_2(D), LIBDEVICE=not _INTERPRETED,
                                enable_fp_fusion=False)
    return out if other is None else (out, out_y)


_INTERPRETED = isinstance(_norm_rope, InterpretedFunction)  # Triton's CPU interpreter (the tests' stage)
