"""The grouped (prefill) expert kernels: a layer call's (token, expert) pairs sorted by expert, each
expert's pairs padded to BLOCK_M rows; one program per (row block, block of output columns) dequantizes
a weight tile of 64 inputs per step (rounded to the activations' dtype, as the reference does) and
feeds it to tl.dot; float32 activations use 3xTF32 (about float32 accuracy). moestream.kernels.triton_moe
launches them (MoEPlan) and documents the record layout, the deterministic sum and the gemv kernels.

The product's shape, from the H200 sweep (scripts/bench_kernels.py --sweep): a word's codes are
unpacked by joins, so they stay in the registers of the thread that loaded the word and the tile's
reshape to [BLOCK_N, 64] moves nothing (unpacked by a broadcast shift and reshaped, the tile went
through shared memory one element at a time: 2x slower); the product is W x^T, the weight rows on the
MMA's M side: Hopper's wgmma for any BLOCK_M (x W^T took the older mma.sync below 64 pairs per tile,
1-10 % slower).
The summation order of a pair's output follows from the tile shapes alone, which depend only on the
call's shape (tokens, experts), never on the cache, so the bits are the same for every cache size.
"""
import triton
import triton.language as tl

from moestream.kernels.triton_expert_math import _bias_f32, _e2m1_f32, _e8m0_f32, _gate_act, _up_act


@triton.jit
def _codes_joined(words, BITS: tl.constexpr):
    """uint32 words [..., W] -> codes [..., W, 32/BITS] (code j of a word at bits j*BITS), built by joins,
    so a word's codes stay in the registers of the thread that loaded it: the tile's later reshape
    and its way into the product need no shuffle through shared memory (a reshape of an expanded
    dim may take one)."""
    M: tl.constexpr = (1 << BITS) - 1
    # a join appends a dim of 2, so the first join's pairs are codes 4 (8-bit: 2) apart, the last's 1 apart
    if BITS == 4:
        c04 = tl.join(words & M, (words >> 16) & M)
        c15 = tl.join((words >> 4) & M, (words >> 20) & M)
        c26 = tl.join((words >> 8) & M, (words >> 24) & M)
        c37 = tl.join((words >> 12) & M, (words >> 28) & M)
        return tl.join(tl.join(c04, c26), tl.join(c15, c37))
    else:
        return tl.join(tl.join(words & M, (words >> 16) & M), tl.join((words >> 8) & M, (words >> 24) & M))


@triton.jit
def _dequant_tile(wq_ptr, ws_ptr, wb_ptr, row_words, row_scales, rows, row_mask, g,
                  BITS: tl.constexpr, BN: tl.constexpr, DTYPE: tl.constexpr, MX: tl.constexpr):
    """Weight tile [BN, 64] of inputs 64g.. for rows [BN], as w = q*s + b rounded to DTYPE (MX:
    w = e2m1(q) * 2^(s - 127), two scales per tile). row_scales: scales per row."""
    CPW: tl.constexpr = 32 // BITS
    GW: tl.constexpr = 64 // CPW
    woff = rows[:, None] * row_words + g * GW + tl.arange(0, GW)[None, :]
    words = tl.load(wq_ptr + woff, mask=row_mask[:, None], other=0).to(tl.uint32, bitcast=True)  # [BN, GW]
    codes = tl.reshape(_codes_joined(words, BITS), (BN, 64))  # [BN, GW, CPW] flattened
    if MX:
        v = tl.reshape(_e2m1_f32(codes), (BN, 2, 32))
        soff = rows[:, None] * row_scales + g * 2 + tl.arange(0, 2)[None, :]
        s = _e8m0_f32(tl.load(ws_ptr + soff, mask=row_mask[:, None], other=0))  # [BN, 2]
        w = tl.reshape(v * s[:, :, None], (BN, 64))
    else:
        q = (codes | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0  # 2^23 + q read as float, minus 2^23
        s = tl.load(ws_ptr + rows * row_scales + g, mask=row_mask, other=0.0).to(tl.float32)
        b = tl.load(wb_ptr + rows * row_scales + g, mask=row_mask, other=0.0).to(tl.float32)
        w = q * s[:, None] + b[:, None]
    return w.to(DTYPE)


@triton.jit
def _block_pairs(b, block_rank_ptr, num_experts, slot_table_ptr, starts_ptr, counts_ptr,
                 block_start_ptr, order_ptr, BM: tl.constexpr):
    """The pairs of row block b: (slot or -1, pair ids [BM], row mask [BM])."""
    u = tl.load(block_rank_ptr + b)  # the expert of this block; num_experts for the unused tail
    valid = u < num_experts
    u = tl.where(valid, u, 0)
    slot = tl.load(slot_table_ptr + u)
    slot = tl.where(valid, slot, -1)
    rows = (b - tl.load(block_start_ptr + u)) * BM + tl.arange(0, BM)
    row_mask = (rows < tl.load(counts_ptr + u)) & valid
    pairs = tl.load(order_ptr + tl.load(starts_ptr + u) + rows, mask=row_mask, other=0)
    return slot, pairs, row_mask


@triton.jit
def _gate_up_grouped(x_ptr, stride_x, block_rank_ptr, num_experts, slot_table_ptr, starts_ptr,
                     counts_ptr, block_start_ptr, order_ptr, pool_w, pool_s, pool_b, slot_words, slot_halves,
                     slot_bias, gw_off, gs_off, gb_off, uw_off, us_off, ub_off, g_add_off, u_add_off, alpha, limit,
                     h_ptr, H: tl.constexpr, I: tl.constexpr, A: tl.constexpr, BITS: tl.constexpr, BM: tl.constexpr,
                     BN: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, ACT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, MX: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    slot, pairs, pmask = _block_pairs(b, block_rank_ptr, num_experts, slot_table_ptr, starts_ptr,
                                      counts_ptr, block_start_ptr, order_ptr, BM)
    if slot >= 0:
        CPW: tl.constexpr = 32 // BITS
        DTYPE: tl.constexpr = x_ptr.dtype.element_ty
        wbase = pool_w + slot.to(tl.int64) * slot_words
        sbase = pool_s + slot.to(tl.int64) * slot_halves
        toks = (pairs // A).to(tl.int64)
        rows = nb * BN + tl.arange(0, BN)
        row_mask = rows < I
        row_words: tl.constexpr = H // CPW
        row_groups: tl.constexpr = H // 64  # steps of 64 inputs
        row_scales: tl.constexpr = H // (32 if MX else 64)
        kk = tl.arange(0, 64)
        # the weight rows are the product's M side: [BN, BM] accumulators (see the module notes)
        acc_g = tl.zeros([BN, BM], dtype=tl.float32)
        acc_u = tl.zeros([BN, BM], dtype=tl.float32)
        for g in range(0, row_groups):
            xt = tl.load(x_ptr + toks[:, None] * stride_x + g * 64 + kk[None, :], mask=pmask[:, None], other=0.0)
            wg = _dequant_tile(wbase + gw_off, sbase + gs_off, sbase + gb_off, row_words, row_scales, rows,
                               row_mask, g, BITS, BN, DTYPE, MX)
            wu = _dequant_tile(wbase + uw_off, sbase + us_off, sbase + ub_off, row_words, row_scales, rows,
                               row_mask, g, BITS, BN, DTYPE, MX)
            if DOT_F32:
                xt = xt.to(tl.float32)
                wg = wg.to(tl.float32)
                wu = wu.to(tl.float32)
            acc_g = tl.dot(wg, tl.trans(xt), acc_g, input_precision=PRECISION)
            acc_u = tl.dot(wu, tl.trans(xt), acc_u, input_precision=PRECISION)
        acc_g = tl.trans(acc_g)
        acc_u = tl.trans(acc_u)
        if HAS_BIAS:
            bbase = pool_b + slot.to(tl.int64) * slot_bias
            acc_g += _bias_f32(bbase + g_add_off, rows, row_mask, DTYPE)[None, :]
            acc_u += _bias_f32(bbase + u_add_off, rows, row_mask, DTYPE)[None, :]
        h = _gate_act(acc_g, alpha, limit, ACT) * _up_act(acc_u, limit, ACT)
        hoff = pairs.to(tl.int64)[:, None] * I + rows[None, :]
        tl.store(h_ptr + hoff, h.to(h_ptr.dtype.element_ty), mask=pmask[:, None] & row_mask[None, :])


@triton.jit
def _down_grouped(h_ptr, rw_ptr, block_rank_ptr, num_experts, slot_table_ptr, starts_ptr,
                  counts_ptr, block_start_ptr, order_ptr, pool_w, pool_s, pool_b, slot_words, slot_halves,
                  slot_bias, dw_off, ds_off, db_off, d_add_off, o_ptr, H: tl.constexpr, I: tl.constexpr,
                  BITS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, PRECISION: tl.constexpr,
                  DOT_F32: tl.constexpr, HAS_BIAS: tl.constexpr, MX: tl.constexpr):
    b = tl.program_id(0)
    nb = tl.program_id(1)
    slot, pairs, pmask = _block_pairs(b, block_rank_ptr, num_experts, slot_table_ptr, starts_ptr,
                                      counts_ptr, block_start_ptr, order_ptr, BM)
    if slot >= 0:
        CPW: tl.constexpr = 32 // BITS
        DTYPE: tl.constexpr = h_ptr.dtype.element_ty
        wbase = pool_w + slot.to(tl.int64) * slot_words
        sbase = pool_s + slot.to(tl.int64) * slot_halves
        prow = pairs.to(tl.int64)
        rows = nb * BN + tl.arange(0, BN)
        row_mask = rows < H
        row_words: tl.constexpr = I // CPW
        row_groups: tl.constexpr = I // 64
        row_scales: tl.constexpr = I // (32 if MX else 64)
        kk = tl.arange(0, 64)
        acc = tl.zeros([BN, BM], dtype=tl.float32)
        for g in range(0, row_groups):
            ht = tl.load(h_ptr + prow[:, None] * I + g * 64 + kk[None, :], mask=pmask[:, None], other=0.0)
            wd = _dequant_tile(wbase + dw_off, sbase + ds_off, sbase + db_off, row_words, row_scales, rows,
                               row_mask, g, BITS, BN, DTYPE, MX)
            if DOT_F32:
                ht = ht.to(tl.float32)
                wd = wd.to(tl.float32)
            acc = tl.dot(wd, tl.trans(ht), acc, input_precision=PRECISION)
        acc = tl.trans(acc)
        w = tl.load(rw_ptr + pairs, mask=pmask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            acc += _bias_f32(pool_b + slot.to(tl.int64) * slot_bias + d_add_off, rows, row_mask, DTYPE)[None, :]
        ooff = prow[:, None] * H + rows[None, :]
        tl.store(o_ptr + ooff, acc * w[:, None], mask=pmask[:, None] & row_mask[None, :])
