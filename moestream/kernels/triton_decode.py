"""Fused Triton kernels for the attention half of a decode step (one token, or T rows at once).

Why: on the GPU a decode step is bound by kernel launches, not by arithmetic. In torch, each
decoder layer's attention half issues about 60 tiny kernels (RMSNorm alone is eight: to(float32),
pow, mean, add, rsqrt, mul, to(dtype), mul). These kernels do the same work in a handful of
launches per layer:

  rms_norm          1 launch   y = rms_norm(x)                          x [T, N]
  add_rms_norm      1 launch   h = x + y, hn = rms_norm(h)              (the residual add; optionally
                               hn in float32 too, in the expert gemv kernels' input order)
  rope_qk_store     1 launch   q/k head norms, rotary, K/V written into the cache at `pos`
  decode_attention  2 launches split-K attention over cache positions 0..pos, then a fixed-order combine

Everything can be captured in a CUDA graph: no host syncs, no host reads of device values, and no
shape or allocation depends on one. The token position is a device tensor read by the kernels, and
the attention loops end at it, so one graph serves every position of a cache.

The `_rows` forms take T rows at once (a step of several tokens, or of several sequences' tokens):
one more grid axis, each row with its own position (and sequence slot), row t computed by the
same arithmetic as alone, so its bits never depend on the rows beside it.

Exactness contract (activations bf16/fp16/fp32, weights in the activation dtype):
  - rms_norm / add_rms_norm compute what moestream.layers.norm.rms_norm does, op by op: statistics
    in float32 (mean of squares as sum * (1/N), + eps, rsqrt), x32 * rstd rounded to the dtype, then
    times the weight rounded to the dtype. Only the float32 summation order differs from torch: it
    can move rstd by an ulp, which rarely moves a bf16/fp16 result by an ulp (two after the weight
    multiply); inputs whose sum of squares is exact in float32 give torch's bits.
  - rope_qk_store rounds like torch: cos/sin in float32 (libdevice, the same code as torch's cosf
    and sinf) rounded to the dtype, each product and the sum rounded to the dtype. Without head
    norms the roped q/k (and the cache rows) are the torch bits; with them, the norm's reduction
    order is the only difference.
  - decode_attention is not bit-compatible with SDPA (no two attention kernels are), but it is
    deterministic: each split is reduced by one program in a fixed order and the splits are
    combined in a fixed order, no atomics. Split boundaries sit at multiples of `split` keys and
    the block sizes follow from the dtype and D, so the bits depend on pos and `split`, not on the
    cache's max_tokens.
The kernels that promise torch's rounding are compiled with enable_fp_fusion=False: a fused
multiply-add would skip a rounding torch does.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.expert_layout import ACT_DTYPES
from moestream.kernels.pdl import pdl_launch

MAX_N = 16384  # rms_norm keeps one whole row in registers
DEFAULT_SPLIT = 128  # keys per attention split (a power of two >= 16)
_COMBINE_SPLITS = 32  # splits the combine kernel reads per step
_LOG2E = 1.4426950408889634


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


@triton.jit
def _head(x_ptr, w_ptr, i, mask, rstd_eps, inv_d, cos, sin, HALF: tl.constexpr, NORM: tl.constexpr,
          DTYPE: tl.constexpr):
    """One head [D] as its two halves: optional per-head RMSNorm, then rotary. Returns the halves in DTYPE."""
    x1 = tl.load(x_ptr + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        rstd = tl.math.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) * inv_d + rstd_eps)
        w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
        x1 = (w1 * (x1 * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
    # x*cos + rotate_half(x)*sin, rotate_half(x) = (-x2, x1); torch rounds each product and the sum
    a1 = (x1 * cos).to(DTYPE).to(tl.float32)
    b1 = (x2 * sin).to(DTYPE).to(tl.float32)
    a2 = (x2 * cos).to(DTYPE).to(tl.float32)
    b2 = (x1 * sin).to(DTYPE).to(tl.float32)
    return (a1 - b1).to(DTYPE), (a2 + b2).to(DTYPE)


@triton.jit
def _slot_of(slot_ptr, num_slots):
    """The row's sequence slot, read from the device and clamped to 0..num_slots-1 (never out of bounds)."""
    return tl.minimum(tl.maximum(tl.load(slot_ptr).to(tl.int64), 0), num_slots - 1)


@triton.jit
def _rope_qk_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, inv_freq_ptr, qn_ptr, kn_ptr, qo_ptr, keys_ptr, values_ptr,
                          stride_kh, stride_kt, stride_vh, stride_vt, max_tokens, eps, inv_d,
                          slot_ptr, stride_ks, stride_vs, num_slots, stride_qr, stride_kr, stride_vr,
                          NQ: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr, Q_NORM: tl.constexpr,
                          K_NORM: tl.constexpr, LIBDEVICE: tl.constexpr, HAS_SLOT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # axis 0, programs 0..NQ-1: query heads; NQ..NQ+NKV-1: key heads, each also copying its value
    # head; axis 1: the row (token), with its own position (and slot)
    # HAS_SLOT: keys/values are every sequence slot's caches, the row's slot read from slot_ptr
    DTYPE: tl.constexpr = qo_ptr.dtype.element_ty
    r = tl.program_id(1)
    q_ptr += r.to(tl.int64) * stride_qr
    k_ptr += r.to(tl.int64) * stride_kr
    v_ptr += r.to(tl.int64) * stride_vr
    qo_ptr += r.to(tl.int64) * (NQ * D)
    pos_ptr += r
    slot_ptr += r
    if HAS_SLOT:
        slot = _slot_of(slot_ptr, num_slots)
        keys_ptr += slot * stride_ks
        values_ptr += slot * stride_vs
    HALF: tl.constexpr = D // 2
    h = tl.program_id(0)
    i = tl.arange(0, BLOCK)
    mask = i < HALF
    pos = tl.load(pos_ptr).to(tl.int64)
    freqs = pos.to(tl.float32) * tl.load(inv_freq_ptr + i, mask=mask, other=0.0)
    if LIBDEVICE:  # accurate cosf/sinf: the hardware approximations are far off at large angles
        cos = libdevice.cos(freqs)
        sin = libdevice.sin(freqs)
    else:  # the interpreter has no libdevice
        cos = tl.cos(freqs)
        sin = tl.sin(freqs)
    cos = cos.to(DTYPE).to(tl.float32)
    sin = sin.to(DTYPE).to(tl.float32)
    if h < NQ:
        o1, o2 = _head(q_ptr + h * D, qn_ptr, i, mask, eps, inv_d, cos, sin, HALF, Q_NORM, DTYPE)
        tl.store(qo_ptr + h * D + i, o1, mask=mask)
        tl.store(qo_ptr + h * D + HALF + i, o2, mask=mask)
    else:
        j = h - NQ
        o1, o2 = _head(k_ptr + j * D, kn_ptr, i, mask, eps, inv_d, cos, sin, HALF, K_NORM, DTYPE)
        ok = mask & (pos < max_tokens)  # a position past the cache is dropped rather than written out of bounds
        kdst = keys_ptr + j.to(tl.int64) * stride_kh + pos * stride_kt
        tl.store(kdst + i, o1, mask=ok)
        tl.store(kdst + HALF + i, o2, mask=ok)
        vdst = values_ptr + j.to(tl.int64) * stride_vh + pos * stride_vt
        tl.store(vdst + i, tl.load(v_ptr + j * D + i, mask=mask), mask=ok)
        tl.store(vdst + HALF + i, tl.load(v_ptr + j * D + HALF + i, mask=mask), mask=ok)


@triton.jit
def _attn_split_kernel(q_ptr, stride_qh, k_ptr, stride_kh, stride_kt, v_ptr, stride_vh, stride_vt, pos_ptr, max_tokens,
                       acc_ptr, m_ptr, l_ptr, num_splits, qk_scale, slot_ptr, stride_ks, stride_vs, num_slots,
                       stride_qr, G: tl.constexpr, GB: tl.constexpr, D: tl.constexpr,
                       BD: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr, PRECISION: tl.constexpr,
                       DOT_F32: tl.constexpr, HAS_SLOT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # One program: row r's G query heads of kv head `kvh` against keys [s*SPLIT, (s+1)*SPLIT) ∩ [0, pos_r].
    # Writes the unnormalized output acc [G, D], the running max m (log2 units) and the sum l.
    # HAS_SLOT: k/v are every sequence slot's caches, the row's slot read from slot_ptr.
    r = tl.program_id(2)
    q_ptr += r.to(tl.int64) * stride_qr
    pos_ptr += r
    slot_ptr += r
    rows_before = (r * tl.num_programs(0) * G).to(tl.int64) * num_splits  # earlier rows' (head, split) entries
    acc_ptr += rows_before * D
    m_ptr += rows_before
    l_ptr += rows_before
    if HAS_SLOT:
        slot = _slot_of(slot_ptr, num_slots)
        k_ptr += slot * stride_ks
        v_ptr += slot * stride_vs
    kvh = tl.program_id(0)
    s = tl.program_id(1)
    pos = tl.minimum(tl.load(pos_ptr).to(tl.int32), max_tokens - 1)
    start = s * SPLIT
    if start <= pos:  # splits past the position do nothing (the combine does not read them)
        end = tl.minimum(start + SPLIT, pos + 1)
        g = tl.arange(0, GB)
        d = tl.arange(0, BD)
        gmask = g < G
        dmask = d < D
        heads = kvh * G + g
        q = tl.load(q_ptr + heads[:, None] * stride_qh + d[None, :], mask=gmask[:, None] & dmask[None, :], other=0.0)
        if DOT_F32:
            q = q.to(tl.float32)
        kbase = k_ptr + kvh.to(tl.int64) * stride_kh
        vbase = v_ptr + kvh.to(tl.int64) * stride_vh
        m_i = tl.full([GB], float("-inf"), tl.float32)
        l_i = tl.zeros([GB], tl.float32)
        acc = tl.zeros([GB, BD], tl.float32)
        # A fixed trip count with a guard rather than range(start, end): the interpreter cannot
        # take loop bounds read from memory, and SPLIT // BLOCK_N is small.
        for b in range(SPLIT // BLOCK_N):
            n0 = start + b * BLOCK_N
            if n0 < end:
                n = n0 + tl.arange(0, BLOCK_N)
                nmask = n < end
                kvmask = nmask[:, None] & dmask[None, :]
                k = tl.load(kbase + n.to(tl.int64)[:, None] * stride_kt + d[None, :], mask=kvmask, other=0.0)
                v = tl.load(vbase + n.to(tl.int64)[:, None] * stride_vt + d[None, :], mask=kvmask, other=0.0)
                if DOT_F32:
                    k = k.to(tl.float32)
                    v = v.to(tl.float32)
                sc = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale  # [GB, BLOCK_N], log2 units
                sc = tl.where(nmask[None, :], sc, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(sc, axis=1))  # finite: every block has a key <= pos
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(sc - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
                m_i = m_new
        row = heads.to(tl.int64) * num_splits + s
        tl.store(acc_ptr + row[:, None] * D + d[None, :], acc, mask=gmask[:, None] & dmask[None, :])
        tl.store(m_ptr + row, m_i, mask=gmask)
        tl.store(l_ptr + row, l_i, mask=gmask)


@triton.jit
def _attn_combine_kernel(acc_ptr, m_ptr, l_ptr, out_ptr, pos_ptr, max_tokens, rows, stride_or,
                         NUM_SPLITS: tl.constexpr, D: tl.constexpr, BD: tl.constexpr, SPLIT: tl.constexpr,
                         SB: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # One program per (query head, output row); splits 0..pos//SPLIT in a fixed order: the same bits
    # every run. Steps of SB splits up to a trip count known at launch, guarded by the device position.
    # Output rows from `rows` on (a fixed-size product's padding) are written as zeros.
    h = tl.program_id(0)
    r = tl.program_id(1)
    d = tl.arange(0, BD)
    dmask = d < D
    dst = out_ptr + r.to(tl.int64) * stride_or + h * D + d
    if r < rows:
        base = (r * tl.num_programs(0) + h).to(tl.int64) * NUM_SPLITS
        pos = tl.minimum(tl.load(pos_ptr + r).to(tl.int32), max_tokens - 1)
        used = pos // SPLIT + 1
        sb = tl.arange(0, SB)
        m_max = tl.full([SB], float("-inf"), tl.float32)
        for s0 in range(0, NUM_SPLITS, SB):
            if s0 < used:
                m_max = tl.maximum(m_max, tl.load(m_ptr + base + s0 + sb, mask=s0 + sb < used, other=float("-inf")))
        m_all = tl.max(m_max, axis=0)
        l_sum = tl.zeros([SB], tl.float32)
        acc = tl.zeros([SB, BD], tl.float32)
        for s0 in range(0, NUM_SPLITS, SB):
            if s0 < used:
                smask = s0 + sb < used
                w = tl.exp2(tl.load(m_ptr + base + s0 + sb, mask=smask, other=float("-inf")) - m_all)  # 0 past `used`
                l_sum += w * tl.load(l_ptr + base + s0 + sb, mask=smask, other=0.0)
                part = tl.load(acc_ptr + (base + s0 + sb)[:, None] * D + d[None, :],
                               mask=smask[:, None] & dmask[None, :], other=0.0)
                acc += w[:, None] * part
        out = tl.sum(acc, axis=0) / tl.sum(l_sum, axis=0)
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dmask)
    else:
        tl.store(dst, tl.zeros([BD], tl.float32).to(out_ptr.dtype.element_ty), mask=dmask)


# Triton's CPU interpreter has no libdevice and multiplies bfloat16 dot operands as their raw bits:
# there the kernels take tl.cos/tl.sin and widen dot operands to float32 first.
_INTERPRETED = isinstance(_rms_norm_kernel, InterpretedFunction)


# -- wrappers ------------------------------------------------------------------------------------------

def _slot_views(keys: torch.Tensor, values: torch.Tensor, slot: torch.Tensor | None, rows: int
                ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """With `slot` (a device tensor of one entry per row): keys/values are [S, Nkv, max_tokens, D],
    every sequence slot's cache of one layer, and row t goes to slot slot[t] (clamped to 0..S-1):
    returns slot 0's [Nkv, max_tokens, D] views and the kernels' slot arguments. Without: as given."""
    if slot is None:
        return keys, values, (keys, 0, 0, 1)
    if keys.dim() != 4 or values.shape != keys.shape or slot.numel() != rows or slot.device != keys.device \
            or (rows > 1 and slot.stride(0) != 1):
        raise ValueError(f"with a slot: keys/values [S, Nkv, max_tokens, D] (got {list(keys.shape)}, "
                         f"{list(values.shape)}) and a contiguous slot tensor of {rows} entries on their device")
    return keys[0], values[0], (slot, keys.stride(0), values.stride(0), keys.shape[0])


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """moestream.layers.norm.rms_norm of x [T, N] (rows may be strided); one program per row."""
    T, N, block, warps = _row_setup(x, weight)
    if out is None:
        out = torch.empty((T, N), dtype=x.dtype, device=x.device)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(-1) != 1:
        raise ValueError(f"out: {out.dtype} {list(out.shape)}, expected {x.dtype} {list(x.shape)}")
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


def rope_qk_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                  keys: torch.Tensor, values: torch.Tensor, *, q_norm: torch.Tensor | None = None,
                  k_norm: torch.Tensor | None = None, eps: float = 1e-6, slot: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """One token's q [1, Nq*D], k, v [1, Nkv*D] (views into a fused qkv output are fine):
    optional per-head RMSNorm of q and k (weights [D]), rotary at the device position pos [1],
    k and v written to keys/values [Nkv, max_tokens, D] at pos. Returns q [Nq, 1, D]. One launch.
    slot: write into sequence slot `slot` of keys/values [S, Nkv, max_tokens, D] (see _slot_views)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.numel() != t.shape[-1]:
            raise ValueError(f"{name}: shape {list(t.shape)}, expected one row")
    out = rope_qk_store_rows(q.reshape(1, -1), k.reshape(1, -1), v.reshape(1, -1), pos.reshape(1), inv_freq, keys,
                             values, q_norm=q_norm, k_norm=k_norm, eps=eps,
                             slot=None if slot is None else slot.reshape(1))
    return out.view(out.shape[1], 1, out.shape[2])


def rope_qk_store_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor,
                       keys: torch.Tensor, values: torch.Tensor, *, q_norm: torch.Tensor | None = None,
                       k_norm: torch.Tensor | None = None, eps: float = 1e-6, slot: torch.Tensor | None = None
                       ) -> torch.Tensor:
    """rope_qk_store for T rows at once: q [T, Nq*D], k, v [T, Nkv*D] (rows may be strided), pos [T]
    device positions (slot [T]: each row's sequence slot). Row t's bits are those it gets alone.
    Returns q [T, Nq, D]. One launch."""
    T = q.shape[0]
    keys, values, slot_args = _slot_views(keys, values, slot, T)
    Nkv, max_tokens, D = keys.shape
    if values.shape != keys.shape or values.dtype != keys.dtype or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys/values: same shape [Nkv, max_tokens, D] and dtype, last dimension contiguous")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_act(name, t)
        if t.dim() != 2 or t.shape[0] != T or t.dtype != q.dtype:
            raise ValueError(f"{name}: shape {list(t.shape)} {t.dtype}, expected {T} {q.dtype} rows")
    if D % 2 or q.shape[-1] % D or k.shape[-1] != Nkv * D or v.shape[-1] != Nkv * D or keys.dtype != q.dtype:
        raise ValueError(f"q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} do not fit {keys.dtype} "
                         f"caches of {Nkv} heads of {D}")
    if inv_freq.shape != (D // 2,) or inv_freq.dtype != torch.float32 or pos.numel() != T or \
            (T > 1 and pos.stride(0) != 1):
        raise ValueError(f"inv_freq must be float32 [D/2] and pos a contiguous device tensor of {T} positions")
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (w.shape != (D,) or w.dtype != q.dtype or not w.is_contiguous()):
            raise ValueError(f"{name}: expected contiguous {q.dtype} [{D}]")
    Nq = q.shape[-1] // D
    q_out = torch.empty((T, Nq, D), dtype=q.dtype, device=q.device)
    block = triton.next_power_of_2(D // 2)
    if T:
        _rope_qk_store_kernel[(Nq + Nkv, T)](
            q, k, v, pos, inv_freq.contiguous(), q if q_norm is None else q_norm, k if k_norm is None else k_norm,
            q_out, keys, values, keys.stride(0), keys.stride(1), values.stride(0), values.stride(1), max_tokens, eps,
            _inv(D), *slot_args, q.stride(0), k.stride(0), v.stride(0), NQ=Nq, D=D, BLOCK=block,
            Q_NORM=q_norm is not None, K_NORM=k_norm is not None, LIBDEVICE=not _INTERPRETED,
            HAS_SLOT=slot is not None, num_warps=1, enable_fp_fusion=False,
            **pdl_launch(q, _INTERPRETED))
    return q_out


def num_splits(max_tokens: int, split: int = DEFAULT_SPLIT) -> int:
    """Programs per kv head of decode_attention's first kernel (from host values only)."""
    return triton.cdiv(max_tokens, split)


def decode_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, *,
                     scale: float | None = None, split: int = DEFAULT_SPLIT, slot: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """Attention of one token's q [Nq, 1, D] over cache positions 0..pos (pos: device tensor [1]) of
    keys/values [Nkv, max_tokens, D], GQA with query head h on kv head h // (Nq/Nkv). Returns
    [1, Nq*D] in q's dtype. Flash-decoding: kernel 1 runs over (kv head, split of `split` keys),
    all the kv head's query heads per program; kernel 2 combines the splits in a fixed order.
    slot: attend over sequence slot `slot` of keys/values [S, Nkv, max_tokens, D] (see _slot_views)."""
    if q.dim() != 3 or q.shape[1] != 1:
        raise ValueError(f"q: shape {list(q.shape)}, expected [Nq, 1, D]")
    return decode_attention_rows(q.transpose(0, 1), keys, values, pos.reshape(1), scale=scale, split=split,
                                 slot=None if slot is None else slot.reshape(1))


def decode_attention_rows(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, pos: torch.Tensor, *,
                          out_rows: int | None = None, scale: float | None = None, split: int = DEFAULT_SPLIT,
                          slot: torch.Tensor | None = None) -> torch.Tensor:
    """decode_attention for T rows at once: q [T, Nq, D], row t over positions 0..pos[t] (of slot
    slot[t] with a slot tensor [T]); row t's bits are those it gets alone. Returns [out_rows, Nq*D]
    (default T) with the rows past T zero: the padded input of a fixed-size product."""
    T = q.shape[0]
    out_rows = T if out_rows is None else out_rows
    keys, values, slot_args = _slot_views(keys, values, slot, T)
    Nkv, max_tokens, D = keys.shape
    _check_act("q", q)
    if q.dim() != 3 or q.shape[2] != D or q.shape[1] % Nkv or out_rows < T:
        raise ValueError(f"q: shape {list(q.shape)}, expected [T, Nq, {D}] with Nq a multiple of {Nkv} "
                         f"(and out_rows >= T)")
    if values.shape != keys.shape or keys.dtype != q.dtype or values.dtype != q.dtype \
            or keys.stride(-1) != 1 or values.stride(-1) != 1:
        raise ValueError("keys/values: same shape [Nkv, max_tokens, D] and dtype as q, last dimension contiguous")
    if split < 16 or split & (split - 1) or pos.numel() != T or (T > 1 and pos.stride(0) != 1):
        raise ValueError(f"split {split}: must be a power of two >= 16; pos a contiguous device tensor of {T}")
    Nq = q.shape[1]
    G = Nq // Nkv
    splits = num_splits(max_tokens, split)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    # tl.dot wants tiles of at least 16 in each dimension; fp32 tiles are kept smaller (FMA dot, registers)
    block_n = min(split, 32 if q.dtype == torch.float32 or D > 128 else 64)
    bd = max(16, triton.next_power_of_2(D))
    acc = torch.empty((T, Nq, splits, D), dtype=torch.float32, device=q.device)
    m = torch.empty((T, Nq, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    if T:
        _attn_split_kernel[(Nkv, splits, T)](
            q, q.stride(1), keys, keys.stride(0), keys.stride(1), values, values.stride(0), values.stride(1), pos,
            max_tokens, acc, m, l, splits, scale * _LOG2E, *slot_args, q.stride(0), G=G,
            GB=max(16, triton.next_power_of_2(G)), D=D, BD=bd, BLOCK_N=block_n, SPLIT=split,
            PRECISION="ieee" if q.dtype == torch.float32 or _INTERPRETED else "tf32",
            DOT_F32=_INTERPRETED, HAS_SLOT=slot is not None, num_warps=4, num_stages=2,
            **pdl_launch(q, _INTERPRETED))
    out = torch.empty((out_rows, Nq * D), dtype=q.dtype, device=q.device)
    if out_rows:
        _attn_combine_kernel[(Nq, out_rows)](acc, m, l, out, pos, max_tokens, T, out.stride(0), NUM_SPLITS=splits,
                                             D=D, BD=bd, SPLIT=split, SB=_COMBINE_SPLITS, num_warps=4,
                                             **pdl_launch(q, _INTERPRETED))
    return out
