"""Grouped quantized MoE FFN in Triton that reads expert records straight out of the slot pool.

Legend: T tokens, H hidden, I expert intermediate, A experts per token, P = T*A (token, expert)
pairs, U unique experts of the layer, E experts of the layer, N slots, S slot bytes.

Three kernels per layer call:
  1. gate/up:  h[p] = act(x[tok] @ Wg^T + bg, x[tok] @ Wu^T + bu)    h [P, I]
  2. down:     o[p] = w[p] * (h[p] @ Wd^T + bd)                      o [P, H] float32
  3. combine:  y[t] = sum over a = 0..A-1 of o[t*A + a]               y [T, H] in x's dtype
     (finish(norm=...): one program per token that also writes the next layer's input norm of y)
Weights are dequantized on the fly from the MLX affine layout (uint32 words, least-significant
bits first, w = q*scale + bias, groups of 64 along the input dim), addressed as
pool[slot] + field offset: the pool is read as int32 words, as scale-dtype halves and as the
dtype of the projections' added biases.

MXFP4 records (moestream.quant.mxfp4) are a compile-time variant (MX) of the same kernels: a row's
bytes hold input 2k in byte k's low nibble and 2k+1 in its high nibble, so a little-endian int32
word m holds input 8m + j at bits 4j..4j+3 -- the affine 4-bit packing. The words are loaded as
before; only the dequantization differs: w = e2m1(code) * 2^(scale - 127), the value built from
the code's bits and one uint8 E8M0 scale per 32 inputs (no quantization biases), exact in float32.

The gated activation is a compile-time choice, the record's (moestream.kernels.reference):
  - silu (SwiGLU):        act(g, u) = silu(g) * u
  - gelu_tanh (Gemma 4):  act(g, u) = gelu_tanh(g) * u
  - clamped_swiglu (gpt-oss), whose records hold the biases bg, bu, bd:
        g' = min(g, limit), u' = clamp(u, -limit, limit), act = (u' + 1) * g' * sigmoid(alpha * g')
    with alpha and limit runtime floats. The biases are rounded to x's dtype, as the reference does,
    and added where it adds them: to gate and up before the activation, to down before the routing
    weight. Without biases that code is not compiled in: SwiGLU's kernels compile to the PTX they
    always did (the same instructions in the same order), so their bits are unchanged.

The reduction over a token's experts is a deterministic second pass, not float atomics: every
pair's o row is computed by exactly one program with a fixed summation order, and the combine
adds them in a fixed order. So the output is bit-for-bit the same from run to run and for any
cache size (a layer's experts may be pinned in several batches; each batch writes only its own
pairs' rows), slot assignment and policy, as the design asks of every path. Atomics would
make the last bits depend on scheduling, and greedy tokens could then change between runs.

Two shapes of work, chosen by T only (so by nothing the cache decides):
  - gemv (decode, T <= 4): one program per (pair, block of output rows), float32 FMAs, bound by
    the bandwidth of the weight bytes. Each code becomes the float 1 + q/2^b by a shift and an
    and-or (no int->float conversion), and the dot is factored per group of 64.
  - grouped (prefill; the kernels in moestream.kernels.triton_grouped): pairs sorted by expert,
    each expert's pairs padded to BLOCK_M rows; one program per (row block, block of output columns)
    dequantizes a [BLOCK_N, 64] weight tile per step and feeds tl.dot.
Nothing here reads device values on the host: the grouping by expert is computed on the device and
the slots come in a device table, so a layer whose experts are all resident runs with no host sync
(and inside a CUDA graph).
"""
from __future__ import annotations

from typing import Sequence

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.expert_layout import (ACT_DTYPES, DEFAULT_CONFIG, GROUP, MX_GROUP, PROJECTIONS, KernelConfig,
                                             SlotLayout, UnsupportedLayout)
from moestream.kernels.triton_decode import MAX_N, _inv, _rms_scale
from moestream.kernels.triton_expert_math import _bias_f32, _code_f32, _e2m1_f32, _e8m0_f32, _gate_act, _up_act
from moestream.kernels.triton_grouped import _down_grouped, _gate_up_grouped
from moestream.kernels.pdl import pdl_launch

# torch -> Triton dtypes: the gemv kernels compute in float32 but round the biases to x's dtype
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# -- kernels ------------------------------------------------------------------------------------------

@triton.jit
def _gate_up_gemv(xs_ptr, ids_ptr, slot_table_ptr, pool_w, pool_s, pool_b, slot_words, slot_halves, slot_bias,
                  gw_off, gs_off, gb_off, uw_off, us_off, ub_off, g_add_off, u_add_off, alpha, limit, h_ptr,
                  H: tl.constexpr, I: tl.constexpr, A: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr,
                  NG: tl.constexpr, H_CPW: tl.constexpr, ACT: tl.constexpr, HAS_BIAS: tl.constexpr,
                  X_DTYPE: tl.constexpr, MX: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # xs [T, CPW, H/CPW] float32 split x; h [P, H_CPW, I/H_CPW] float32, split for the down kernel.
    # g_add_off, u_add_off: gate_proj.bias, up_proj.bias in pool_b (the added biases, not the quantization's)
    # MX: pool_s is the pool's bytes (E8M0 scales, one per 32 inputs; slot_halves is then in bytes)
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slot_table_ptr + tl.load(ids_ptr + pair))
    if slot >= 0:  # else the expert belongs to another batch of this call
        CPW: tl.constexpr = 32 // BITS
        GS: tl.constexpr = 32 if MX else 64  # inputs per scale
        GW: tl.constexpr = GS // CPW  # words per group
        ROW_WORDS: tl.constexpr = H // CPW
        ROW_GROUPS: tl.constexpr = H // GS
        wbase = pool_w + slot.to(tl.int64) * slot_words
        sbase = pool_s + slot.to(tl.int64) * slot_halves
        xrow = xs_ptr + (pair // A).to(tl.int64) * H
        rows = nb * BN + tl.arange(0, BN)
        rmask = (rows < I)[:, None, None]
        gi = tl.arange(0, NG)
        col = gi[:, None] * GW + tl.arange(0, GW)[None, :]  # [NG, GW] word within a step
        acc_g = tl.zeros([BN, NG, GW], dtype=tl.float32)
        acc_u = tl.zeros([BN, NG, GW], dtype=tl.float32)
        for m0 in range(0, ROW_WORDS, NG * GW):
            m = m0 + col
            mmask = m < ROW_WORDS
            woff = rows[:, None, None] * ROW_WORDS + m[None, :, :]  # [BN, NG, GW]
            wmask = rmask & mmask[None, :, :]
            wg = tl.load(wbase + gw_off + woff, mask=wmask, other=0).to(tl.uint32, bitcast=True)
            wu = tl.load(wbase + uw_off + woff, mask=wmask, other=0).to(tl.uint32, bitcast=True)
            soff = rows[:, None, None] * ROW_GROUPS + (m0 // GW + gi)[None, :, None]  # [BN, NG, 1]
            smask = rmask & (m0 // GW + gi < ROW_GROUPS)[None, :, None]
            if MX:  # per group of 32: 2^(s - 127) * sum e2m1(q) x
                sg = _e8m0_f32(tl.load(sbase + gs_off + soff, mask=smask, other=0))
                su = _e8m0_f32(tl.load(sbase + us_off + soff, mask=smask, other=0))
                tg = tl.zeros([BN, NG, GW], dtype=tl.float32)
                tu = tl.zeros([BN, NG, GW], dtype=tl.float32)
                for j in tl.static_range(CPW):
                    xj = tl.load(xrow + j * ROW_WORDS + m, mask=mmask, other=0.0)
                    tg += _e2m1_f32((wg >> (4 * j)) & 15) * xj[None, :, :]
                    tu += _e2m1_f32((wu >> (4 * j)) & 15) * xj[None, :, :]
                acc_g += sg * tg
                acc_u += su * tu
            else:
                sg = tl.load(sbase + gs_off + soff, mask=smask, other=0.0).to(tl.float32) * (1 << BITS)
                bg = tl.load(sbase + gb_off + soff, mask=smask, other=0.0).to(tl.float32) - sg
                su = tl.load(sbase + us_off + soff, mask=smask, other=0.0).to(tl.float32) * (1 << BITS)
                bu = tl.load(sbase + ub_off + soff, mask=smask, other=0.0).to(tl.float32) - su
                tg = tl.zeros([BN, NG, GW], dtype=tl.float32)
                tu = tl.zeros([BN, NG, GW], dtype=tl.float32)
                xsum = tl.zeros([NG, GW], dtype=tl.float32)
                for j in tl.static_range(CPW):
                    xj = tl.load(xrow + j * ROW_WORDS + m, mask=mmask, other=0.0)
                    tg += _code_f32(wg, j, BITS) * xj[None, :, :]
                    tu += _code_f32(wu, j, BITS) * xj[None, :, :]
                    xsum += xj
                acc_g += sg * tg + bg * xsum[None, :, :]
                acc_u += su * tu + bu * xsum[None, :, :]
        bbase = pool_b + slot.to(tl.int64) * slot_bias
        gate = tl.sum(tl.sum(acc_g, axis=2), axis=1)
        if HAS_BIAS:
            gate += _bias_f32(bbase + g_add_off, rows, rows < I, X_DTYPE)
        act = _gate_act(gate, alpha, limit, ACT)
        up = tl.sum(tl.sum(acc_u, axis=2), axis=1)
        if HAS_BIAS:
            up += _bias_f32(bbase + u_add_off, rows, rows < I, X_DTYPE)
        h = act * _up_act(up, limit, ACT)
        hoff = (rows % H_CPW) * (I // H_CPW) + rows // H_CPW
        tl.store(h_ptr + pair.to(tl.int64) * I + hoff, h, mask=rows < I)


@triton.jit
def _down_gemv(hs_ptr, ids_ptr, rw_ptr, slot_table_ptr, pool_w, pool_s, pool_b, slot_words, slot_halves, slot_bias,
               dw_off, ds_off, db_off, d_add_off, o_ptr, H: tl.constexpr, I: tl.constexpr,
               BITS: tl.constexpr, BN: tl.constexpr, NG: tl.constexpr, HAS_BIAS: tl.constexpr, X_DTYPE: tl.constexpr,
               MX: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # hs [P, CPW, I/CPW] float32 split h; o [P, H] float32
    pair = tl.program_id(0)
    nb = tl.program_id(1)
    slot = tl.load(slot_table_ptr + tl.load(ids_ptr + pair))
    if slot >= 0:
        CPW: tl.constexpr = 32 // BITS
        GS: tl.constexpr = 32 if MX else 64
        GW: tl.constexpr = GS // CPW
        ROW_WORDS: tl.constexpr = I // CPW
        ROW_GROUPS: tl.constexpr = I // GS
        wbase = pool_w + slot.to(tl.int64) * slot_words
        sbase = pool_s + slot.to(tl.int64) * slot_halves
        hrow = hs_ptr + pair.to(tl.int64) * I
        rows = nb * BN + tl.arange(0, BN)
        rmask = (rows < H)[:, None, None]
        gi = tl.arange(0, NG)
        col = gi[:, None] * GW + tl.arange(0, GW)[None, :]
        acc = tl.zeros([BN, NG, GW], dtype=tl.float32)
        for m0 in range(0, ROW_WORDS, NG * GW):
            m = m0 + col
            mmask = m < ROW_WORDS
            woff = rows[:, None, None] * ROW_WORDS + m[None, :, :]
            wd = tl.load(wbase + dw_off + woff, mask=rmask & mmask[None, :, :], other=0).to(tl.uint32, bitcast=True)
            soff = rows[:, None, None] * ROW_GROUPS + (m0 // GW + gi)[None, :, None]
            smask = rmask & (m0 // GW + gi < ROW_GROUPS)[None, :, None]
            if MX:
                sd = _e8m0_f32(tl.load(sbase + ds_off + soff, mask=smask, other=0))
                td = tl.zeros([BN, NG, GW], dtype=tl.float32)
                for j in tl.static_range(CPW):
                    xj = tl.load(hrow + j * ROW_WORDS + m, mask=mmask, other=0.0)
                    td += _e2m1_f32((wd >> (4 * j)) & 15) * xj[None, :, :]
                acc += sd * td
            else:
                sd = tl.load(sbase + ds_off + soff, mask=smask, other=0.0).to(tl.float32) * (1 << BITS)
                bd = tl.load(sbase + db_off + soff, mask=smask, other=0.0).to(tl.float32) - sd
                td = tl.zeros([BN, NG, GW], dtype=tl.float32)
                xsum = tl.zeros([NG, GW], dtype=tl.float32)
                for j in tl.static_range(CPW):
                    xj = tl.load(hrow + j * ROW_WORDS + m, mask=mmask, other=0.0)
                    td += _code_f32(wd, j, BITS) * xj[None, :, :]
                    xsum += xj
                acc += sd * td + bd * xsum[None, :, :]
        w = tl.load(rw_ptr + pair).to(tl.float32)
        y = tl.sum(tl.sum(acc, axis=2), axis=1)
        if HAS_BIAS:
            y += _bias_f32(pool_b + slot.to(tl.int64) * slot_bias + d_add_off, rows, rows < H, X_DTYPE)
        y = y * w
        tl.store(o_ptr + pair.to(tl.int64) * H + rows, y, mask=rows < H)


@triton.jit
def _combine(o_ptr, y_ptr, res_ptr, T, H, A: tl.constexpr, HAS_RESIDUAL: tl.constexpr, BT: tl.constexpr,
             BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # o [T*A, H] float32 -> y [T, H] (+ the residual res [T, H], added after rounding y as torch would)
    toks = tl.program_id(0) * BT + tl.arange(0, BT)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = (toks < T)[:, None] & (cols < H)[None, :]
    rows = toks.to(tl.int64)[:, None] * A * H + cols[None, :]
    acc = tl.zeros([BT, BLOCK], dtype=tl.float32)
    for a in tl.static_range(A):  # fixed order: the sum is the same bits every time
        acc += tl.load(o_ptr + rows + a * H, mask=mask, other=0.0)
    out = acc.to(y_ptr.dtype.element_ty)
    yoff = toks.to(tl.int64)[:, None] * H + cols[None, :]
    if HAS_RESIDUAL:
        out = (tl.load(res_ptr + yoff, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + yoff, out, mask=mask)


@triton.jit
def _combine_norm(o_ptr, y_ptr, res_ptr, w_ptr, n_ptr, H, eps, inv_n, A: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
                  BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # _combine for one token's whole row (y's bits are _combine's: the same per-column sums), then the
    # next layer's input RMSNorm of y with weight w into n [T, H] (triton_decode.rms_norm's arithmetic)
    DTYPE: tl.constexpr = y_ptr.dtype.element_ty
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for a in tl.static_range(A):
        acc += tl.load(o_ptr + (t * A + a) * H + cols, mask=mask, other=0.0)
    out = acc.to(DTYPE)
    if HAS_RESIDUAL:
        out = (tl.load(res_ptr + t * H + cols, mask=mask, other=0.0).to(tl.float32) + out.to(tl.float32)).to(DTYPE)
    tl.store(y_ptr + t * H + cols, out, mask=mask)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(n_ptr + t * H + cols, _rms_scale(out.to(tl.float32), w, eps, inv_n, DTYPE), mask=mask)


# Triton's CPU interpreter multiplies bfloat16 dot operands as their raw bits; there the operands
# (already rounded to the activation dtype) are widened to float32 first, which gives the same products.
_INTERPRETED = isinstance(_combine, InterpretedFunction)


# -- launcher ------------------------------------------------------------------------------------------

def _device_ints(values: Sequence[int], device: torch.device, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    """A small host list as a device tensor without a host sync (pinned, async copy)."""
    t = torch.tensor(list(values), dtype=dtype)
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def slot_table(num_experts: int, experts: Sequence[int], slots: Sequence[int], device: torch.device) -> torch.Tensor:
    """int32 [E] device table: the slot of each of `experts`, -1 for every other expert."""
    table = [-1] * num_experts
    for e, s in zip(experts, slots, strict=True):
        if s is None:
            raise ValueError(f"expert {e} is not in a slot")
        table[e] = s
    return _device_ints(table, device)


def expert_counts(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int64 [E]: how many of `ids` name each expert. (torch.bincount would sync with the host on
    CUDA to size its output; a scatter into E zeros does not.)"""
    ids = ids.reshape(-1).to(torch.int64)
    return torch.zeros(num_experts, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))


def _block_m(pairs: int, num_experts: int, config: KernelConfig) -> int:
    """Pairs per row block, from the call's shape alone (pairs and the layer's expert count)."""
    if config.block_m:
        return config.block_m
    want = config.block_m_scale * pairs / max(1, num_experts)  # the mean pairs per expert, scaled
    bm = 16
    while bm < want and bm < config.block_m_max:
        bm *= 2
    return bm


def grouped_block_m(tokens: int, top_k: int, num_experts: int, dtype: torch.dtype,
                    config: KernelConfig = DEFAULT_CONFIG) -> int:
    """The grouped kernels' row block for a call of `tokens` tokens (MoEPlan's choice)."""
    return min(_block_m(tokens * top_k, num_experts, config), 32 if dtype == torch.float32 else 256)


def _groups_per_step(words: int, bits: int, group: int = GROUP) -> int:
    return max(1, words // (group * bits // 32))  # a group of `group` codes is group*bits/32 words


class MoEPlan:
    """One layer call of the routed experts: `run` once per batch of pinned experts, then `finish`.

    x [T, H]; ids [T, A] expert ids in 0..num_experts-1; weights [T, A] routing weights. Everything
    here stays on the device (no host sync): the grouping by expert is computed from `ids` there,
    and each `run` takes a device slot table, so the whole call can be captured in a CUDA graph."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int,
                 layout: SlotLayout, *, mode: str = "auto", config: KernelConfig = DEFAULT_CONFIG,
                 tile_tokens: int | None = None, split_x: torch.Tensor | None = None):
        """tile_tokens: the token count the kernel and tile choices are made for, where x's rows past
        it are padding (a prefill graph's length bucket): the real rows then get the bits of a call of
        tile_tokens rows, since padding pairs sort after theirs.
        split_x: x already in the gemv kernels' input order (`split_shape`; e.g. written by the kernel
        that computed x: triton_decode.add_rms_norm's split), which the gemv mode then reads in place
        of a copy of its own; the grouped mode does not read it."""
        if x.dtype not in ACT_DTYPES:
            raise UnsupportedLayout(f"activations in {x.dtype}")
        if x.dim() != 2 or x.shape[1] != layout.hidden:
            raise ValueError(f"x {list(x.shape)} does not match hidden size {layout.hidden}")
        if ids.shape != weights.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
            raise ValueError(f"ids {list(ids.shape)} / weights {list(weights.shape)} do not match x {list(x.shape)}")
        if mode not in ("auto", "gemv", "grouped"):
            raise ValueError(f"mode {mode!r} (auto, gemv or grouped)")
        self.x = x if x.stride(1) == 1 else x.contiguous()
        self.layout, self.config, self.num_experts = layout, config, num_experts
        self.tokens, self.top_k = ids.shape
        self.ids = ids.reshape(-1).contiguous()  # [P]
        self.weights = weights.reshape(-1).contiguous()  # [P]
        chosen_for = self.tokens if tile_tokens is None else tile_tokens
        self.mode = mode if mode != "auto" else "gemv" if chosen_for <= config.gemv_max_tokens else "grouped"
        pairs, dev = self.ids.numel(), x.device
        self.o = torch.empty((pairs, layout.hidden), dtype=torch.float32, device=dev)  # [P, H]
        if self.mode == "gemv":
            # x in split order (see the gemv kernels) and float32; h is written split for the down kernel
            shape = split_shape(layout, self.tokens)
            if split_x is not None:
                if split_x.shape != shape or split_x.dtype != torch.float32 or not split_x.is_contiguous():
                    raise ValueError(f"split_x: {split_x.dtype} {list(split_x.shape)}, expected contiguous "
                                     f"float32 {list(shape)}")
                self.xs = split_x
            else:
                self.xs = torch.empty(shape, dtype=torch.float32, device=dev)
                self.xs.copy_(self.x.view(self.tokens, shape[2], shape[1]).transpose(1, 2))
            self.h = torch.empty((pairs, layout.inter), dtype=torch.float32, device=dev)  # [P, I]
        else:
            self.h = torch.empty((pairs, layout.inter), dtype=x.dtype, device=dev)  # [P, I]
            fp32 = x.dtype == torch.float32
            # float32 activations: three tf32 passes (about float32 accuracy), which need smaller tiles
            self.precision = "tf32x3" if fp32 else "tf32"
            self.block_m = grouped_block_m(chosen_for, self.top_k, num_experts, x.dtype, config)
            self.warps = max(config.grouped_warps, 8) if fp32 else config.grouped_warps
            if pairs:
                self._group(dev)

    def _group(self, dev: torch.device) -> None:
        """Sort the pairs by expert and cut each expert's run into BLOCK_M row blocks (device ops only)."""
        pairs, bm = self.ids.numel(), self.block_m
        _, self.order = torch.sort(self.ids, stable=True)  # order [P]: pair ids grouped by expert
        self.counts = expert_counts(self.ids, self.num_experts)  # [E]
        self.starts = torch.cumsum(self.counts, 0) - self.counts  # [E] first sorted position of each expert
        blocks = (self.counts + bm - 1) // bm
        block_end = torch.cumsum(blocks, 0)
        self.block_start = block_end - blocks  # [E] first row block of each expert
        self.num_blocks = triton.cdiv(pairs, bm) + min(pairs, self.num_experts)  # an upper bound known on the host
        # block_rank [num_blocks]: the expert of each row block; E for the unused tail
        self.block_rank = torch.searchsorted(block_end, torch.arange(self.num_blocks, device=dev), right=True)

    def run(self, pool: torch.Tensor, experts: Sequence[int], slots: Sequence[int]) -> None:
        """Queue the pairs routed to `experts`, whose records sit in `pool[slots[i]]`. Those slots
        must keep their records until the queued work has run."""
        if experts:
            self.run_table(pool, slot_table(self.num_experts, experts, slots, pool.device))

    def run_table(self, pool: torch.Tensor, table: torch.Tensor) -> None:
        """Queue the pairs whose expert has a slot in `table` (int32 [E] device tensor, -1: not in
        this batch); the other pairs are left for another call."""
        if not self.ids.numel():
            return
        if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.stride(1) != 1 or pool.stride(0) % 4:
            raise ValueError("pool must be a uint8 [slots, slot_bytes] tensor with 4-byte aligned rows")
        self.gate_up(pool, table)
        self.down(pool, table)

    def _pool_views(self, pool: torch.Tensor):
        """The pool as int32 words, as scale-dtype halves (MXFP4: bytes) and as the added biases' dtype
        (same memory; without biases the halves stand in, unread), and the field offsets in those units
        (0 for the fields a layout does not have, unread)."""
        lay = self.layout
        words, halves = pool.view(torch.int32), pool.view(lay.scale_dtype)
        adds = pool.view(lay.bias_dtype) if lay.has_bias else halves
        unit = {"weight": 4, "scales": halves.element_size(), "biases": halves.element_size(),
                "bias": adds.element_size()}
        off = {k: v // unit[k.rsplit(".", 1)[1]] for k, v in lay.offsets.items()}
        off.update({f"{p}.{part}": 0 for p in PROJECTIONS for part in ("biases", "bias") if f"{p}.{part}" not in off})
        return (words, halves, adds, words.stride(0), halves.stride(0), adds.stride(0)), off

    def _act_args(self) -> dict:
        """The compile-time activation and bias choice of the gate/up kernels."""
        return dict(ACT=self.layout.activation, HAS_BIAS=self.layout.has_bias, MX=self.layout.mx)

    def _scale_group(self) -> int:
        """Inputs per scale: the gemv kernels' group."""
        return MX_GROUP if self.layout.mx else GROUP

    def _x_dtype(self):
        """The gemv kernels' X_DTYPE (the biases are rounded to it); one fixed value where nothing
        reads it, so records without biases compile one gemv kernel for every activation dtype."""
        return _TL_DTYPES[self.x.dtype] if self.layout.has_bias else tl.float32

    def gate_up(self, pool: torch.Tensor, slot_table: torch.Tensor) -> None:
        """Kernel 1: h = act(x Wg^T + bg, x Wu^T + bu) for this batch's pairs."""
        lay, cfg = self.layout, self.config
        views, off = self._pool_views(pool)
        common = (*views, off["gate_proj.weight"], off["gate_proj.scales"], off["gate_proj.biases"],
                  off["up_proj.weight"], off["up_proj.scales"], off["up_proj.biases"], off["gate_proj.bias"],
                  off["up_proj.bias"], lay.alpha, lay.limit, self.h, lay.hidden, lay.inter, self.top_k)
        bits = lay.bits_gate_up
        if self.mode == "gemv":
            grid = (self.ids.numel(), triton.cdiv(lay.inter, cfg.gemv_gate_up_n))
            _gate_up_gemv[grid](self.xs, self.ids, slot_table, *common, BITS=bits, BN=cfg.gemv_gate_up_n,
                                NG=_groups_per_step(cfg.gemv_gate_up_words, bits, self._scale_group()),
                                H_CPW=32 // lay.bits_down, X_DTYPE=self._x_dtype(), **self._act_args(),
                                num_warps=cfg.gemv_gate_up_warps, **pdl_launch(self.x, _INTERPRETED))
        else:
            grid = (self.num_blocks, triton.cdiv(lay.inter, cfg.gate_up_n))
            _gate_up_grouped[grid](self.x, self.x.stride(0), self.block_rank, self.num_experts,
                                   slot_table, self.starts, self.counts, self.block_start, self.order, *common,
                                   BITS=bits, BM=self.block_m, BN=cfg.gate_up_n, PRECISION=self.precision,
                                   DOT_F32=_INTERPRETED, **self._act_args(),
                                   num_warps=self.warps, num_stages=cfg.grouped_stages)

    def down(self, pool: torch.Tensor, slot_table: torch.Tensor) -> None:
        """Kernel 2: o[p] = w[p] * (h[p] Wd^T + bd) for this batch's pairs."""
        lay, cfg = self.layout, self.config
        views, off = self._pool_views(pool)
        common = (*views, off["down_proj.weight"], off["down_proj.scales"], off["down_proj.biases"],
                  off["down_proj.bias"], self.o, lay.hidden, lay.inter)
        bits = lay.bits_down
        if self.mode == "gemv":
            grid = (self.ids.numel(), triton.cdiv(lay.hidden, cfg.gemv_down_n))
            _down_gemv[grid](self.h, self.ids, self.weights, slot_table, *common, BITS=bits, BN=cfg.gemv_down_n,
                             NG=_groups_per_step(cfg.gemv_down_words, bits, self._scale_group()), HAS_BIAS=lay.has_bias,
                             X_DTYPE=self._x_dtype(), MX=lay.mx, num_warps=cfg.gemv_down_warps,
                             **pdl_launch(self.x, _INTERPRETED))
        else:
            grid = (self.num_blocks, triton.cdiv(lay.hidden, cfg.down_n))
            _down_grouped[grid](self.h, self.weights, self.block_rank, self.num_experts,
                                slot_table, self.starts, self.counts, self.block_start, self.order, *common,
                                BITS=bits, BM=self.block_m, BN=cfg.down_n, PRECISION=self.precision,
                                DOT_F32=_INTERPRETED, HAS_BIAS=lay.has_bias, MX=lay.mx,
                                num_warps=self.warps, num_stages=cfg.grouped_stages)

    def finish(self, residual: torch.Tensor | None = None, *, out: torch.Tensor | None = None,
               norm: tuple | None = None) -> torch.Tensor:
        """Kernel 3: y [T, H] in x's dtype, each token's pairs summed in top-k order a = 0..A-1;
        with `residual` [T, H], returns residual + y (rounded once more, like a separate add).
        `out`: a contiguous [T, H] tensor to write into (may be the residual itself).
        norm: (weight [H], eps, normed [T, H]): the same kernel also writes rms_norm(y) into normed
        (the next layer's input norm, triton_decode.rms_norm's arithmetic); y's bits are the same."""
        lay = self.layout
        y = out if out is not None else torch.empty((self.tokens, lay.hidden), dtype=self.x.dtype, device=self.x.device)
        if norm is not None:
            self._finish_norm(residual, y, *norm)
        elif self.tokens:
            bt, block = self.config.combine_tokens, self.config.combine_block
            grid = (triton.cdiv(self.tokens, bt), triton.cdiv(lay.hidden, block))
            res = residual if residual is not None else y
            _combine[grid](self.o, y, res, self.tokens, lay.hidden, self.top_k, HAS_RESIDUAL=residual is not None,
                           BT=bt, BLOCK=block, **pdl_launch(y, _INTERPRETED))
        return y

    def _finish_norm(self, residual: torch.Tensor | None, y: torch.Tensor, weight: torch.Tensor, eps: float,
                     normed: torch.Tensor) -> None:
        """finish with the norm: one program per token over its whole row."""
        T, H = self.tokens, self.layout.hidden
        for name, t in (("out", y), ("residual", residual), ("normed", normed)):
            if t is not None and (t.shape != (T, H) or t.dtype != self.x.dtype or not t.is_contiguous()):
                raise ValueError(f"{name}: {t.dtype} {list(t.shape)}, expected contiguous {self.x.dtype} [{T}, {H}]")
        if weight.shape != (H,) or weight.dtype != self.x.dtype or not weight.is_contiguous() or H > MAX_N:
            raise ValueError(f"norm weight: {weight.dtype} {list(weight.shape)}, expected contiguous {self.x.dtype} "
                             f"[{H}] (H <= {MAX_N})")
        if T:
            block = triton.next_power_of_2(H)
            _combine_norm[(T,)](self.o, y, y if residual is None else residual, weight, normed, H, eps, _inv(H),
                                A=self.top_k, HAS_RESIDUAL=residual is not None, BLOCK=block,
                                num_warps=min(16, max(1, block // 256)), enable_fp_fusion=False,
                                **pdl_launch(y, _INTERPRETED))


def split_shape(layout: SlotLayout, tokens: int) -> tuple[int, int, int]:
    """The gemv kernels' float32 input [T, C, H/C] (C codes per uint32 word of gate/up): x[t, n] at
    [t, n % C, n // C]."""
    cpw = 32 // layout.bits_gate_up
    return (tokens, cpw, layout.hidden // cpw)


def grouped_moe_ffn(x: torch.Tensor, pool: torch.Tensor, layout: SlotLayout, ids: torch.Tensor,
                    weights: torch.Tensor, experts: Sequence[int], slots: Sequence[int], *, mode: str = "auto",
                    config: KernelConfig = DEFAULT_CONFIG, num_experts: int | None = None) -> torch.Tensor:
    """sum over a of weights[t, a] * FFN_{ids[t, a]}(x[t]) for every token, all experts in one batch.

    x [T, H]; pool [N, S] uint8; ids, weights [T, A]; experts: sorted unique ids of `ids`;
    slots[i]: the slot holding experts[i]'s record. Returns y [T, H] in x's dtype."""
    num_experts = num_experts or (max(experts) + 1 if experts else 1)
    plan = MoEPlan(x, ids, weights, num_experts, layout, mode=mode, config=config)
    plan.run(pool, experts, slots)
    return plan.finish()


__all__ = ["MoEPlan", "grouped_moe_ffn", "slot_table", "expert_counts", "split_shape"]
