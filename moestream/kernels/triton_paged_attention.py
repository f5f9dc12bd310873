"""Attention over a paged KV cache in Triton: decode (split-K, flash-decoding), prefill (row tiles) and
the cache write.

Legend: T rows (tokens) of the call, Nq query heads, Nkv kv heads, G = Nq / Nkv query heads per kv
head, D key (and query) head size, Dv value head size, NB physical blocks of the pool, BS positions
per block, S sequences, MB block-table entries per sequence, NS splits of a decode row.

Row t belongs to sequence seq_of_row[t] and sits at position positions[t]; it attends to that
sequence's positions max(0, pos - window + 1) .. pos. Position p of sequence s lives in physical
block block_table[s, p // BS], slot p % BS of k_cache [NB, BS, Nkv, D] / v_cache [NB, BS, Nkv, Dv].
Scores are q.k * scale, optionally soft-capped (softcap * tanh(score / softcap)), and an optional
per-head sink logit joins the softmax's denominator only. Accumulation is float32, online softmax.

One kernel (_attn_kernel) does the work of both attention entry points. A program takes a tile
of rows (BLOCK_R rows of the call x the G query heads of one kv head: M = BLOCK_R * GP MMA rows) and
walks blocks of BLOCK_N keys with tl.dot, each block's physical rows looked up in the block table;
the tile's rows of one sequence share each block they need (one pass per sequence in the tile,
usually one), so K/V are read once per kv head and tile, not per query head or per row.

  paged_attention  2 launches   decode: grid (row tiles, kv heads, splits); split s of each row's
                                keys, partial results per (row, head, split); a second kernel
                                combines a row's splits in a fixed order (flash-decoding)
  paged_prefill    1 launch     grid (row tiles, kv heads): each row over all its keys, normalized
  store_kv         1 launch     k/v rows scattered into their blocks

Everything can be captured in a CUDA graph: no device value is read on the host, and every shape
and grid follows from the tensors' shapes. Positions past the table (>= MB * BS), sequence ids
outside 0..S-1 and physical block ids outside 0..NB-1 are clamped in the kernels so that a bad
value cannot read or write out of bounds (store_kv drops such a row instead).

Row independence (the bits a row gets never depend on T, on the other rows of the call, or on its
place among them):
  - a tile walks blocks aligned at multiples of BLOCK_N in absolute positions, so a row's keys fall
    into the same blocks whatever the other rows; a block outside a row's keys is masked for it and
    leaves its running max, sum and accumulator exactly as they were; each output of an MMA is one
    row's (the interpreter, whose tl.dot rounds by a row's place, takes sums of products instead).
    Tile sizes and the decode split rule follow from the dtype and head sizes, never from T.
  - decode: a row's split size (chunk) follows from its own visible span only: the smallest multiple
    of BLOCK_N, at least min_chunk, that covers the span in at most max_splits splits, the splits
    aligned at multiples of chunk in absolute positions. Each split of a row is reduced by one
    program in key order, the combine adds splits in index order, no atomics. The grid's split
    axis only bounds the splits; it never changes what a row computes.
  - prefill bits may differ from decode bits within the dtype's tolerance.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.expert_layout import ACT_DTYPES
from moestream.kernels.pdl import pdl_launch

_COMBINE_ELEMENTS = 4096  # split partials x value features the combine kernel holds per step (registers)
_LOG2E = 1.4426950408889634


# -- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _row_keys(pos_ptr, max_pos, window, WINDOWED: tl.constexpr):
    """The row's position (clamped to 0..max_pos-1) and its first visible position."""
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr).to(tl.int32), 0), max_pos - 1)
    lo = tl.maximum(pos - window + 1, 0) if WINDOWED else pos * 0
    return pos, lo


@triton.jit
def _row_chunk(pos, lo, min_chunk, max_splits, BLOCK_N: tl.constexpr):
    """Keys per split of a decode row: a multiple of BLOCK_N, at least min_chunk, and large enough that
    the splits (aligned at multiples of it) covering lo..pos are at most max_splits. From the row alone."""
    span = pos - lo + 1
    need = tl.cdiv(tl.cdiv(span, max_splits - 1), BLOCK_N) * BLOCK_N
    return tl.maximum(need, min_chunk)


@triton.jit
def _clamp(x, n):
    return tl.minimum(tl.maximum(x, 0), n - 1)


@triton.jit
def _mm(a, b, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """a [M, K] @ b [K, N] in float32. Under the interpreter as a sum of products: its tl.dot (a BLAS
    call) rounds a row differently by the row's place in the tile; an MMA does not."""
    if DOT_F32:
        return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _attend_block(n0, m_i, l_i, acc, q0, q_ptr, q_off, q_ok, bt_ptr, max_blocks, num_blocks,
                  k_ptr, stride_kb, stride_ks, v_ptr, stride_vb, stride_vs, key_lo, key_hi, k_first, k_last,
                  scale, qk_scale, softcap,
                  D: tl.constexpr, BKD: tl.constexpr, NUM_DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                  BS: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, GAPS: tl.constexpr,
                  DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """One block of BLOCK_N keys (positions n0 ..) of one kv head against M query rows: online
    softmax update of the running max m_i [M] (log2 units), sum l_i [M] and output acc [M, BDV].
    Keys k_first .. k_last are loaded; row i sees keys key_lo[i] .. key_hi[i] of them (none: its
    state stays as it was, exactly). GAPS: some key between k_first and k_last may be seen by no
    row. q0: the [M, BKD] query tile when NUM_DK == 1, else q is read chunk by chunk at q_ptr + q_off."""
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = (n >= k_first) & (n <= k_last)
    phys = _clamp(tl.load(bt_ptr + n // BS, mask=n_ok & (n // BS < max_blocks), other=0), num_blocks)
    k_rows = phys.to(tl.int64) * stride_kb + (n % BS).to(tl.int64) * stride_ks  # [BLOCK_N]
    v_rows = phys.to(tl.int64) * stride_vb + (n % BS).to(tl.int64) * stride_vs
    if NUM_DK == 1:
        d = tl.arange(0, BKD)
        k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=n_ok[:, None] & (d < D)[None, :], other=0.0)
        sc = _mm(q0, tl.trans(k), DOT_F32, PRECISION)  # [M, BLOCK_N]
    else:
        sc = tl.zeros([q_off.shape[0], BLOCK_N], tl.float32)
        for c in tl.static_range(NUM_DK):
            d = c * BKD + tl.arange(0, BKD)
            dm = d < D
            q = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=q_ok[:, None] & dm[None, :], other=0.0)
            k = tl.load(k_ptr + k_rows[:, None] + d[None, :], mask=n_ok[:, None] & dm[None, :], other=0.0)
            sc += _mm(q, tl.trans(k), DOT_F32, PRECISION)
    if SOFTCAP:  # softcap * tanh(s / softcap), tanh(x) = 1 - 2 / (exp(2x) + 1): exact limits at +-inf
        x = sc * scale / softcap
        sc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)) * 1.4426950408889634
    else:
        sc = sc * qk_scale
    seen = (n[None, :] >= key_lo[:, None]) & (n[None, :] <= key_hi[:, None])
    sc = tl.where(seen, sc, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(sc, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen no key yet stays (0, 0, 0)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(sc - m_use[:, None])
    # values only of keys some row sees: a slot between the rows' ranges may hold anything (a freed
    # block, NaN), and p = 0 times NaN would still be NaN. Without gaps every loaded key is seen: the
    # mask needs no reduction over the rows and the loads of V need not wait for the scores.
    if GAPS:
        v_ok = n_ok & (tl.max(seen.to(tl.int32), axis=0) > 0)
    else:
        v_ok = n_ok
    dv = tl.arange(0, BDV)
    v = tl.load(v_ptr + v_rows[:, None] + dv[None, :], mask=v_ok[:, None] & (dv < DV)[None, :], other=0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, DOT_F32, PRECISION)
    return m_new, l_i, acc


@triton.jit
def _attend_keys(first, m_i, l_i, acc, q0, q_ptr, q_off, q_ok, bt_ptr, max_blocks, num_blocks,
                 k_ptr, stride_kb, stride_ks, v_ptr, stride_vb, stride_vs, key_lo, key_hi, k_first, k_last,
                 scale, qk_scale, softcap,
                 D: tl.constexpr, BKD: tl.constexpr, NUM_DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                 BS: tl.constexpr, BLOCK_N: tl.constexpr, SOFTCAP: tl.constexpr, GAPS: tl.constexpr,
                 WHILE_LOOP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr):
    """_attend_block over the blocks first, first + BLOCK_N, .. up to k_last, in order."""
    if WHILE_LOOP:  # the interpreter takes no loop bounds read from memory
        n0 = first
        while n0 <= k_last:
            m_i, l_i, acc = _attend_block(n0, m_i, l_i, acc, q0, q_ptr, q_off, q_ok, bt_ptr, max_blocks, num_blocks,
                                          k_ptr, stride_kb, stride_ks, v_ptr, stride_vb, stride_vs, key_lo, key_hi,
                                          k_first, k_last, scale, qk_scale, softcap, D, BKD, NUM_DK, DV, BDV, BS,
                                          BLOCK_N, SOFTCAP, GAPS, DOT_F32, PRECISION)
            n0 += BLOCK_N
    else:
        for n0 in range(first, k_last + 1, BLOCK_N):
            m_i, l_i, acc = _attend_block(n0, m_i, l_i, acc, q0, q_ptr, q_off, q_ok, bt_ptr, max_blocks, num_blocks,
                                          k_ptr, stride_kb, stride_ks, v_ptr, stride_vb, stride_vs, key_lo, key_hi,
                                          k_first, k_last, scale, qk_scale, softcap, D, BKD, NUM_DK, DV, BDV, BS,
                                          BLOCK_N, SOFTCAP, GAPS, DOT_F32, PRECISION)
    return m_i, l_i, acc


@triton.jit
def _attn_kernel(q_ptr, stride_qt, stride_qh, k_ptr, stride_kb, stride_ks, stride_kh, v_ptr, stride_vb, stride_vs,
                 stride_vh, bt_ptr, stride_bt, pos_ptr, seq_ptr, num_seqs, max_blocks, num_blocks, window,
                 min_chunk, max_splits, scale, qk_scale, softcap, sinks_ptr, out_ptr, stride_or, acc_ptr, m_ptr, l_ptr,
                 grid_splits, NQ, rows, out_rows,
                 G: tl.constexpr, GP: tl.constexpr, BLOCK_R: tl.constexpr, D: tl.constexpr, BKD: tl.constexpr,
                 NUM_DK: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                 WINDOWED: tl.constexpr, SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, SPLIT: tl.constexpr,
                 WHILE_LOOP: tl.constexpr, DOT_F32: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # One program: rows tile*BLOCK_R .. +BLOCK_R, the G query heads of kv head `kvh` each: M = BLOCK_R * GP
    # MMA rows, row i = (call row r_i, head g_i). SPLIT (decode): each row over split s of its own keys,
    # the unnormalized output acc [G, Dv], running max m (log2 units) and sum l written per (row, head,
    # split) for the combine; else (prefill) each row over all its keys, the output written. The rows'
    # sequences in turn, one pass each (usually one): a pass reads each block of its sequence once.
    M: tl.constexpr = BLOCK_R * GP
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    i = tl.arange(0, M)
    r = tile * BLOCK_R + i // GP
    g = i % GP
    head = kvh * G + g
    real = (r < rows) & (g < G)
    max_pos = max_blocks * BS
    pos = tl.minimum(tl.maximum(tl.load(pos_ptr + r, mask=real, other=0).to(tl.int32), 0), max_pos - 1)
    lo = tl.maximum(pos - window + 1, 0) if WINDOWED else pos * 0
    if SPLIT:
        chunk = _row_chunk(pos, lo, min_chunk, max_splits, BLOCK_N)
        split0 = (lo // chunk + s) * chunk
        start = tl.maximum(split0, lo)
        last = tl.minimum(split0 + chunk, pos + 1) - 1
        active = real & (start <= last)  # splits past a row's keys do nothing (the combine does not read them)
    else:
        start = lo
        last = pos
        active = real
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, BDV], tl.float32)
    if tl.sum(active.to(tl.int32), axis=0) > 0:
        seq = _clamp(tl.load(seq_ptr + r, mask=real, other=0).to(tl.int32), num_seqs)
        k_ptr += kvh.to(tl.int64) * stride_kh
        v_ptr += kvh.to(tl.int64) * stride_vh
        q_off = r.to(tl.int64) * stride_qt + head.to(tl.int64) * stride_qh
        d = tl.arange(0, BKD)
        q0 = tl.load(q_ptr + q_off[:, None] + d[None, :], mask=real[:, None] & (d < D)[None, :], other=0.0)
        done = ~active
        for _ in range(BLOCK_R):  # at most one pass per row
            if tl.sum((~done).to(tl.int32), axis=0) > 0:
                cur = tl.min(tl.where(done, num_seqs, seq), axis=0)
                sel = (~done) & (seq == cur)
                key_lo = tl.where(sel, start, max_pos)
                key_hi = tl.where(sel, last, -1)
                k_first = tl.min(key_lo, axis=0)
                k_last = tl.max(key_hi, axis=0)
                seq_bt = bt_ptr + cur.to(tl.int64) * stride_bt
                first = k_first // BLOCK_N * BLOCK_N  # blocks at multiples of BLOCK_N: a row's blocks whatever the pass
                # the rows' ranges meet or touch pairwise: their union k_first .. k_last has no gap
                joined = tl.max(tl.where(sel, start, -1), axis=0) <= tl.min(tl.where(sel, last, max_pos), axis=0) + 1
                if joined:
                    m_i, l_i, acc = _attend_keys(first, m_i, l_i, acc, q0, q_ptr, q_off, real, seq_bt, max_blocks,
                                                 num_blocks, k_ptr, stride_kb, stride_ks, v_ptr, stride_vb, stride_vs,
                                                 key_lo, key_hi, k_first, k_last, scale, qk_scale, softcap, D, BKD,
                                                 NUM_DK, DV, BDV, BS, BLOCK_N, SOFTCAP, False, WHILE_LOOP, DOT_F32,
                                                 PRECISION)
                else:
                    m_i, l_i, acc = _attend_keys(first, m_i, l_i, acc, q0, q_ptr, q_off, real, seq_bt, max_blocks,
                                                 num_blocks, k_ptr, stride_kb, stride_ks, v_ptr, stride_vb, stride_vs,
                                                 key_lo, key_hi, k_first, k_last, scale, qk_scale, softcap, D, BKD,
                                                 NUM_DK, DV, BDV, BS, BLOCK_N, SOFTCAP, True, WHILE_LOOP, DOT_F32,
                                                 PRECISION)
                done = done | sel
    dv = tl.arange(0, BDV)
    if SPLIT:
        part = (r * NQ + head).to(tl.int64) * grid_splits + s
        tl.store(acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=active[:, None] & (dv < DV)[None, :])
        tl.store(m_ptr + part, m_i, mask=active)
        tl.store(l_ptr + part, l_i, mask=active)
    else:
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + head, mask=g < G, other=0.0) * 1.4426950408889634
            m_fin = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_fin)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_fin)
        out = acc / tl.where(real, l_i, 1.0)[:, None]
        out = tl.where(real[:, None], out, 0.0)
        dst = out_ptr + r.to(tl.int64)[:, None] * stride_or + (head * DV)[:, None] + dv[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty),
                 mask=((r < out_rows) & (g < G))[:, None] & (dv < DV)[None, :])


@triton.jit
def _combine_kernel(acc_ptr, m_ptr, l_ptr, sinks_ptr, out_ptr, pos_ptr, max_blocks, window, min_chunk, max_splits,
                    rows, stride_or, NUM_SPLITS: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr, BS: tl.constexpr,
                    BLOCK_N: tl.constexpr, SB: tl.constexpr, WINDOWED: tl.constexpr, HAS_SINKS: tl.constexpr,
                    PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # One program per (query head, output row): the row's splits in index order, SB at a time, in the
    # same lanes whatever the grid: the same bits every run. Rows from `rows` on are written as zeros.
    h = tl.program_id(0)
    r = tl.program_id(1)
    dv = tl.arange(0, BDV)
    dmask = dv < DV
    dst = out_ptr + r.to(tl.int64) * stride_or + h * DV + dv
    if r < rows:
        pos, lo = _row_keys(pos_ptr + r, max_blocks * BS, window, WINDOWED)
        chunk = _row_chunk(pos, lo, min_chunk, max_splits, BLOCK_N)
        used = pos // chunk - lo // chunk + 1
        base = (r * tl.num_programs(0) + h).to(tl.int64) * NUM_SPLITS
        sb = tl.arange(0, SB)
        m_max = tl.full([SB], float("-inf"), tl.float32)
        for s0 in range(0, NUM_SPLITS, SB):
            if s0 < used:
                m_max = tl.maximum(m_max, tl.load(m_ptr + base + s0 + sb, mask=s0 + sb < used, other=float("-inf")))
        m_all = tl.max(m_max, axis=0)
        if HAS_SINKS:
            sink = tl.load(sinks_ptr + h) * 1.4426950408889634
            m_all = tl.maximum(m_all, sink)
        l_sum = tl.zeros([SB], tl.float32)
        acc = tl.zeros([SB, BDV], tl.float32)
        for s0 in range(0, NUM_SPLITS, SB):
            if s0 < used:
                smask = s0 + sb < used
                w = tl.exp2(tl.load(m_ptr + base + s0 + sb, mask=smask, other=float("-inf")) - m_all)  # 0 past `used`
                l_sum += w * tl.load(l_ptr + base + s0 + sb, mask=smask, other=0.0)
                part = tl.load(acc_ptr + (base + s0 + sb)[:, None] * DV + dv[None, :],
                               mask=smask[:, None] & dmask[None, :], other=0.0)
                acc += w[:, None] * part
        total = tl.sum(l_sum, axis=0)
        if HAS_SINKS:
            total += tl.exp2(sink - m_all)
        out = tl.sum(acc, axis=0) / total
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dmask)
    else:
        tl.store(dst, tl.zeros([BDV], tl.float32).to(out_ptr.dtype.element_ty), mask=dmask)


@triton.jit
def _store_kv_kernel(k_ptr, stride_kt, stride_kh, v_ptr, stride_vt, stride_vh, pos_ptr, seq_ptr, bt_ptr, stride_bt,
                     num_seqs, max_blocks, num_blocks, kc_ptr, stride_cb, stride_cs, stride_ch, vc_ptr, stride_wb,
                     stride_ws, stride_wh, D: tl.constexpr, BD: tl.constexpr, DV: tl.constexpr, BDV: tl.constexpr,
                     BS: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # One program per (row, kv head). A row whose position or block is outside the table is dropped.
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    seq = _clamp(tl.load(seq_ptr + t).to(tl.int64), num_seqs)
    inside = (pos >= 0) & (pos < max_blocks * BS)
    phys = tl.load(bt_ptr + seq * stride_bt + pos // BS, mask=inside, other=-1).to(tl.int64)
    ok = inside & (phys >= 0) & (phys < num_blocks)
    slot = pos % BS
    d = tl.arange(0, BD)
    k = tl.load(k_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=d < D)
    tl.store(kc_ptr + phys * stride_cb + slot * stride_cs + h * stride_ch + d, k, mask=ok & (d < D))
    dv = tl.arange(0, BDV)
    v = tl.load(v_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + dv, mask=dv < DV)
    tl.store(vc_ptr + phys * stride_wb + slot * stride_ws + h * stride_wh + dv, v, mask=ok & (dv < DV))


# Triton's CPU interpreter takes no loop bounds read from memory, and its tl.dot rounds a row by its place
# in the tile (and multiplies bfloat16 operands as raw bits): there the kernels loop with `while` and
# take products as float32 sums (_mm).
_INTERPRETED = isinstance(_attn_kernel, InterpretedFunction)


# -- wrappers ------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class PagedShape:
    """The sizes a call's tensors agree on (legend above)."""
    T: int
    Nq: int
    Nkv: int
    D: int
    Dv: int
    NB: int
    BS: int
    S: int
    MB: int

    @property
    def G(self) -> int:
        return self.Nq // self.Nkv


def _check_index(name: str, t: torch.Tensor, T: int, device: torch.device) -> None:
    if t.dim() != 1 or t.numel() != T or t.dtype not in (torch.int32, torch.int64) or t.device != device \
            or (T > 1 and t.stride(0) != 1):
        raise ValueError(f"{name}: expected a contiguous int32/int64 tensor of {T} entries on {device} "
                         f"(got {t.dtype} {list(t.shape)} on {t.device})")


def _check_cache(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device) -> None:
    if t.dim() != 4 or t.dtype != dtype or t.device != device or t.stride(-1) != 1:
        raise ValueError(f"{name}: expected {dtype} [NB, BS, Nkv, D] on {device} with a contiguous last "
                         f"dimension (got {t.dtype} {list(t.shape)} on {t.device})")


def _paged_shape(rows: torch.Tensor, Nh: int, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, positions: torch.Tensor, seq_of_row: torch.Tensor) -> PagedShape:
    """Checks the cache, table and index tensors against rows [T, Nh, D]; returns the call's sizes."""
    if rows.dtype not in ACT_DTYPES or rows.dim() != 3 or rows.stride(-1) != 1:
        raise ValueError(f"expected [T, heads, D] rows in {ACT_DTYPES} with a contiguous last dimension "
                         f"(got {rows.dtype} {list(rows.shape)})")
    T, _, D = rows.shape
    device = rows.device
    _check_cache("k_cache", k_cache, rows.dtype, device)
    _check_cache("v_cache", v_cache, rows.dtype, device)
    NB, BS, Nkv, Dk = k_cache.shape
    if Dk != D or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache {list(k_cache.shape)} / v_cache {list(v_cache.shape)} do not fit heads of {D}")
    if Nh % Nkv:
        raise ValueError(f"{Nh} heads do not divide into {Nkv} kv heads")
    if block_table.dim() != 2 or block_table.dtype != torch.int32 or block_table.device != device \
            or block_table.stride(-1) != 1 or block_table.shape[1] == 0:
        raise ValueError(f"block_table: expected int32 [S, MB] on {device} with a contiguous last dimension "
                         f"(got {block_table.dtype} {list(block_table.shape)})")
    _check_index("positions", positions, T, device)
    _check_index("seq_of_row", seq_of_row, T, device)
    return PagedShape(T, Nh, Nkv, D, v_cache.shape[3], NB, BS, block_table.shape[0], block_table.shape[1])


def _check_options(shape: PagedShape, device: torch.device, window: int | None, sinks: torch.Tensor | None,
                   softcap: float | None, out_rows: int | None) -> int:
    if window is not None and window < 1:
        raise ValueError(f"window {window}: must be at least 1")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap {softcap}: must be positive")
    if sinks is not None and (sinks.shape != (shape.Nq,) or sinks.dtype != torch.float32 or sinks.device != device
                              or not sinks.is_contiguous()):
        raise ValueError(f"sinks: expected contiguous float32 [{shape.Nq}] on {device}")
    out_rows = shape.T if out_rows is None else out_rows
    if out_rows < shape.T:
        raise ValueError(f"out_rows {out_rows}: fewer than the {shape.T} rows")
    return out_rows


def _key_tiles(D: int) -> tuple[int, int]:
    """(BKD, NUM_DK): head sizes up to 256 in one tile, larger ones in chunks (576 = 9 x 64)."""
    whole = max(16, triton.next_power_of_2(D))
    if whole <= 256:
        return whole, 1
    bkd = 128 if D % 128 == 0 else 64 if D % 64 == 0 else 128
    return bkd, triton.cdiv(D, bkd)


def _cache_args(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple:
    return (k_cache, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            v_cache, v_cache.stride(0), v_cache.stride(1), v_cache.stride(2))


@dataclass(frozen=True)
class Tile:
    """A program's rows: block_r call rows x gp (G padded to a power of two) query heads, M = block_r * gp
    MMA rows (at least 16), against blocks of block_n keys. From the dtype and head sizes alone, never T."""
    block_r: int
    gp: int
    block_n: int
    warps: int
    stages: int


def _tile(dtype: torch.dtype, G: int, D: int, Dv: int, m: int, block_n: int, warps: int, stages: int) -> Tile:
    gp = triton.next_power_of_2(G)
    if block_n * (D + Dv) * dtype.itemsize > 64 << 10:  # two stages of K and V would not fit shared memory
        stages = 1
    return Tile(max(1, max(m, 16) // gp), gp, block_n, warps, stages)


def decode_tile(dtype: torch.dtype, G: int, D: int, Dv: int) -> Tile:
    """Decode: the fewest MMA rows (16; more where G pads past them) up to 256 features a head: one row
    of a call wastes little of the MMA, and each program is short (a single row's step is bound by the
    latency of its loads). Narrow heads take more keys a step, wide ones fewer; past 256 features 32
    rows (several rows of a step share their sequence's K/V at no cost to one row)."""
    wide = max(D, Dv)
    if dtype == torch.float32:
        return _tile(dtype, G, D, Dv, 16, 32, 4, 2)
    if wide <= 256:
        return _tile(dtype, G, D, Dv, 16, 128 if wide <= 64 else 64 if wide <= 128 else 32, 4, 2)
    return _tile(dtype, G, D, Dv, 32, 32, 8, 2)


def decode_split_rule(dtype: torch.dtype, D: int, Dv: int) -> tuple[int, int]:
    """(min_chunk, max_splits) of a decode row: few, long splits (each program streams its keys with
    loads in flight; the combine is cheap), fewer still for narrow heads, whose key rows are short."""
    wide = max(D, Dv)
    if dtype == torch.float32 or wide > 128:
        return 64, 64
    return 128, 32 if wide <= 64 else 64


def prefill_tile(dtype: torch.dtype, G: int, D: int, Dv: int) -> Tile:
    """Prefill: 128 MMA rows up to 256 features a head (8 warps from 128 features on), 32 in float32
    or past 256 features."""
    wide = max(D, Dv)
    if dtype == torch.float32:
        return _tile(dtype, G, D, Dv, 32, 32, 4 if wide <= 256 else 8, 2)
    if wide <= 128:
        return _tile(dtype, G, D, Dv, 128, 64, 4 if wide <= 64 else 8, 2)
    return _tile(dtype, G, D, Dv, 128 if wide <= 256 else 32, 32, 8, 2)


def decode_splits(shape: PagedShape, window: int | None, *, min_chunk: int, max_splits: int) -> int:
    """The decode grid's split axis: the most splits any row of these shapes can use (host values only)."""
    span = shape.MB * shape.BS if window is None else min(window, shape.MB * shape.BS)
    return min(max_splits, triton.cdiv(span - 1, min_chunk) + 1)


def _launch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
            positions: torch.Tensor, seq_of_row: torch.Tensor, shape: PagedShape, tile: Tile, grid: tuple, *,
            scale: float, window: int | None, sinks: torch.Tensor | None, softcap: float | None, out: torch.Tensor,
            out_rows: int, split: tuple | None) -> None:
    """_attn_kernel; split: (acc, m, l, splits, min_chunk, max_splits) for decode, None for prefill."""
    acc, m, l, splits, min_chunk, max_splits = split or (out, out, out, 1, 1, 2)
    bkd, num_dk = _key_tiles(shape.D)
    _attn_kernel[grid](
        q, q.stride(0), q.stride(1), *_cache_args(k_cache, v_cache), block_table, block_table.stride(0), positions,
        seq_of_row, shape.S, shape.MB, shape.NB, 0 if window is None else window, min_chunk, max_splits, scale,
        scale * _LOG2E, softcap or 1.0, out if sinks is None else sinks, out, out.stride(0), acc, m, l, splits,
        shape.Nq, shape.T, out_rows, G=shape.G, GP=tile.gp, BLOCK_R=tile.block_r, D=shape.D, BKD=bkd,
        NUM_DK=num_dk, DV=shape.Dv, BDV=max(16, triton.next_power_of_2(shape.Dv)), BS=shape.BS,
        BLOCK_N=tile.block_n, WINDOWED=window is not None, SOFTCAP=softcap is not None,
        HAS_SINKS=sinks is not None, SPLIT=split is not None, WHILE_LOOP=_INTERPRETED, DOT_F32=_INTERPRETED,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=tile.warps, num_stages=tile.stages,
        **pdl_launch(q, _INTERPRETED))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                    positions: torch.Tensor, seq_of_row: torch.Tensor, *, scale: float, window: int | None = None,
                    sinks: torch.Tensor | None = None, softcap: float | None = None, out_rows: int | None = None,
                    min_chunk: int | None = None, max_splits: int | None = None) -> torch.Tensor:
    """Decode attention of q [T, Nq, D] (rows may be strided) over the paged cache: row t over positions
    max(0, pos_t - window + 1) .. pos_t of sequence seq_of_row[t]. Returns [out_rows or T, Nq*Dv] in q's
    dtype, rows past T zero. v_cache may be a view into k_cache (latent attention: the values are the
    keys' first Dv features). Flash-decoding: kernel 1 over (tile of rows, kv head, split), kernel 2
    combines a row's splits. Row t's bits depend on its own q, position, window and sequence only (and
    on min_chunk / max_splits, the split rule (None: decode_split_rule's; keep the defaults wherever bits
    are compared)."""
    shape = _paged_shape(q, q.shape[1], k_cache, v_cache, block_table, positions, seq_of_row)
    out_rows = _check_options(shape, q.device, window, sinks, softcap, out_rows)
    tile = decode_tile(q.dtype, shape.G, shape.D, shape.Dv)
    rule = decode_split_rule(q.dtype, shape.D, shape.Dv)
    min_chunk = rule[0] if min_chunk is None else min_chunk
    max_splits = rule[1] if max_splits is None else max_splits
    if min_chunk < tile.block_n or min_chunk % tile.block_n or max_splits < 2:
        raise ValueError(f"min_chunk {min_chunk}: a multiple of {tile.block_n}; max_splits {max_splits}: at least 2")
    T, Nq, Dv = shape.T, shape.Nq, shape.Dv
    splits = decode_splits(shape, window, min_chunk=min_chunk, max_splits=max_splits)
    acc = torch.empty((T, Nq, splits, Dv), dtype=torch.float32, device=q.device)
    m = torch.empty((T, Nq, splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    out = torch.empty((out_rows, Nq * Dv), dtype=q.dtype, device=q.device)
    if T:
        _launch(q, k_cache, v_cache, block_table, positions, seq_of_row, shape, tile,
                (triton.cdiv(T, tile.block_r), shape.Nkv, splits), scale=scale, window=window, sinks=sinks,
                softcap=softcap, out=out, out_rows=T, split=(acc, m, l, splits, min_chunk, max_splits))
    if out_rows:
        bdv = max(16, triton.next_power_of_2(Dv))
        _combine_kernel[(Nq, out_rows)](
            acc, m, l, m if sinks is None else sinks, out, positions, shape.MB, 0 if window is None else window,
            min_chunk, max_splits, T, out.stride(0), NUM_SPLITS=splits, DV=Dv, BDV=bdv, BS=shape.BS,
            BLOCK_N=tile.block_n, SB=max(1, min(32, _COMBINE_ELEMENTS // bdv)), WINDOWED=window is not None,
            HAS_SINKS=sinks is not None, num_warps=4, **pdl_launch(q, _INTERPRETED))
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                  positions: torch.Tensor, seq_of_row: torch.Tensor, *, scale: float, window: int | None = None,
                  sinks: torch.Tensor | None = None, softcap: float | None = None, out_rows: int | None = None
                  ) -> torch.Tensor:
    """paged_attention for many rows (a prompt chunk, one or several sequences): tiles of rows x G query
    heads against blocks of keys with tl.dot, each row over all its keys in one program. Same arguments
    and result; the bits may differ from paged_attention's within the dtype's tolerance, and a row's
    bits never depend on the other rows of its tile. The rows' K/V must be in the cache already
    (store_kv first)."""
    shape = _paged_shape(q, q.shape[1], k_cache, v_cache, block_table, positions, seq_of_row)
    out_rows = _check_options(shape, q.device, window, sinks, softcap, out_rows)
    tile = prefill_tile(q.dtype, shape.G, shape.D, shape.Dv)
    out = torch.empty((out_rows, shape.Nq * shape.Dv), dtype=q.dtype, device=q.device)
    if out_rows:
        _launch(q, k_cache, v_cache, block_table, positions, seq_of_row, shape, tile,
                (triton.cdiv(out_rows, tile.block_r), shape.Nkv, 1), scale=scale, window=window, sinks=sinks,
                softcap=softcap, out=out, out_rows=out_rows, split=None)
    return out


def store_kv(k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, seq_of_row: torch.Tensor,
             block_table: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Writes k [T, Nkv, D] and v [T, Nkv, Dv] (rows may be strided) at each row's position of its
    sequence: k_cache[block_table[s, p // BS], p % BS] = k[t]. A row whose position or block lies
    outside the table or pool is not written. One launch."""
    shape = _paged_shape(k, k.shape[1], k_cache, v_cache, block_table, positions, seq_of_row)
    if k.shape[1] != shape.Nkv or v.dim() != 3 or v.shape != (shape.T, shape.Nkv, shape.Dv) \
            or v.dtype != k.dtype or v.stride(-1) != 1:
        raise ValueError(f"k {list(k.shape)} / v {list(v.shape)}: expected [T, {shape.Nkv}, D] and "
                         f"[T, {shape.Nkv}, {shape.Dv}] of one dtype, last dimension contiguous")
    if shape.T:
        _store_kv_kernel[(shape.T, shape.Nkv)](
            k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1), positions, seq_of_row, block_table,
            block_table.stride(0), shape.S, shape.MB, shape.NB, *_cache_args(k_cache, v_cache), D=shape.D,
            BD=triton.next_power_of_2(shape.D), DV=shape.Dv, BDV=triton.next_power_of_2(shape.Dv), BS=shape.BS,
            num_warps=1, **pdl_launch(k, _INTERPRETED))
