"""The device's side of the CPU share's mailbox (moestream.cpu_share.share) as Triton programs.

Each reads the count of misses the layer's lookup withheld, which the lookup wrote in device memory
(moestream.experts.device_map, `withheld`), so a call that withheld nothing costs a few programs
that return at once: nothing posted to host RAM, no wait (moestream.kernels.triton_wait), no rows
taken, no fallback lookup, copy or compute. No host read anywhere: a CUDA graph holds them all.

  - post: the layer's input rows (in the worker's dtype), ids, weights, which pairs are withheld
    and the header (layer, tokens, pairs, misses) into pinned RAM; the device's sequence number + 1;
  - publish, the next program in the stream (a kernel's writes are done before the next one
    starts): that sequence number into the header, last, which starts the worker;
  - take_rows: the worker's rows into the plan's per-pair output for the withheld pairs, where the
    answer came (read across PCIe for those pairs only);
  - lost_pairs: where it did not, the pairs the device computes after all: the fallback lookup's
    ids (a held expert in every other place), the lost ids, the lookup's gate, the count;
  - redo_table: after that lookup, the layer's slot table for the lost experts only (-1 elsewhere)."""
from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from moestream.kernels.pdl import pdl_launch

BLOCK_H = 1024  # the hidden size is a compile-time constant (one per model): the loops over it unroll


@triton.jit
def _post(withheld_ptr, seq_ptr, x_ptr, x_stride, ids_ptr, w_ptr, table_ptr, layer, T, P, H: tl.constexpr, x_out, ids_out, w_out,
          mask_out, head_out, BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    if tl.load(withheld_ptr) > 0:
        for h0 in range(0, H, BLOCK_H):
            h = h0 + tl.arange(0, BLOCK_H)
            keep = h < H
            v = tl.load(x_ptr + t * x_stride + h, mask=keep)
            tl.store(x_out + t * H + h, v.to(x_out.dtype.element_ty), mask=keep)
        if t == 0:
            p = tl.arange(0, BLOCK_P)
            valid = p < P
            e = tl.load(ids_ptr + p, mask=valid, other=0)
            tl.store(ids_out + p, e.to(tl.int32), mask=valid)
            tl.store(w_out + p, tl.load(w_ptr + p, mask=valid, other=0).to(tl.float32), mask=valid)
            away = tl.load(table_ptr + e, mask=valid, other=0) < 0
            tl.store(mask_out + p, away.to(tl.int8), mask=valid)
            tl.store(head_out + 1, tl.full([], layer, tl.int64))
            tl.store(head_out + 2, tl.full([], T, tl.int64))
            tl.store(head_out + 3, tl.full([], P, tl.int64))
            tl.store(head_out + 4, tl.load(withheld_ptr + 1))
            tl.store(seq_ptr, tl.load(seq_ptr) + 1)


@triton.jit
def _publish(withheld_ptr, seq_ptr, head_out, empty_ptr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    if tl.load(withheld_ptr) > 0:
        tl.store(head_out, tl.load(seq_ptr))
    else:
        tl.store(empty_ptr, tl.load(empty_ptr) + 1)


@triton.jit
def _take_rows(withheld_ptr, ok_ptr, ids_ptr, table_ptr, rows_ptr, o_ptr, H: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.program_id(0)
    if tl.load(withheld_ptr) > 0:
        if tl.load(ok_ptr) != 0:
            if tl.load(table_ptr + tl.load(ids_ptr + p)) < 0:
                for h0 in range(0, H, BLOCK_H):
                    h = h0 + tl.arange(0, BLOCK_H)
                    keep = h < H
                    tl.store(o_ptr + p * H + h, tl.load(rows_ptr + p * H + h, mask=keep), mask=keep)


@triton.jit
def _lost_pairs(withheld_ptr, ok_ptr, ids_ptr, table_ptr, P, lookup_out, lost_out, gate_out, lost_count_ptr,
                BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    p = tl.arange(0, BLOCK_P)
    valid = p < P
    fail = (tl.load(withheld_ptr) > 0) & (tl.load(ok_ptr) == 0)
    e = tl.load(ids_ptr + p, mask=valid, other=0).to(tl.int32)
    held = tl.load(table_ptr + e, mask=valid, other=0) >= 0
    lost = valid & (held == 0) & fail
    # a held pair's expert everywhere else: the fallback lookup loads nothing but the lost ones
    first_held = tl.min(tl.where(valid & held, p, BLOCK_P), 0)
    filler = tl.sum(tl.where(p == first_held, e, 0), 0)
    tl.store(lookup_out + p, tl.where(lost, e, filler), mask=valid)
    tl.store(lost_out + p, tl.where(lost, e, -1), mask=valid)
    n_lost = tl.sum(lost.to(tl.int64), 0)
    tl.store(gate_out, (n_lost > 0).to(tl.int32))
    tl.store(lost_count_ptr, tl.load(lost_count_ptr) + n_lost)


@triton.jit
def _redo_table(gate_ptr, lost_ptr, table_ptr, E, P, redo_out, BLOCK_E: tl.constexpr, BLOCK_P: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    e = tl.arange(0, BLOCK_E)
    live = e < E
    p = tl.arange(0, BLOCK_P)
    go = tl.load(gate_ptr) != 0
    lost = tl.load(lost_ptr + p, mask=(p < P) & go, other=-1)
    mine = tl.sum(((lost[None, :] == e[:, None]) & go).to(tl.int32), 1) > 0
    slot = tl.load(table_ptr + e, mask=live & mine, other=-1)
    tl.store(redo_out + e, tl.where(mine, slot, -1), mask=live)


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def post(withheld, seq, x, ids, weights, table, layer: int, x_out, ids_out, w_out, mask_out, head_out) -> None:
    """Where withheld[0] > 0: x [T, H] into x_out (its dtype), ids / weights [P] (flat, contiguous)
    into ids_out (int32) / w_out (float32), table[ids] < 0 into mask_out (int8), head_out[1:5] =
    (layer, T, P, withheld[1]) (int64), seq[0] += 1. The outputs are pinned RAM's device views."""
    x = x if x.stride(1) == 1 else x.contiguous()
    T, H = x.shape
    P = ids.numel()
    _post[(T,)](withheld, seq, x, x.stride(0), ids, weights, table, layer, T, P, H, x_out, ids_out, w_out, mask_out,
                head_out, BLOCK_H=min(BLOCK_H, triton.next_power_of_2(H)), BLOCK_P=_block(P), num_warps=4,
                **pdl_launch(x, _INTERPRETED))


def publish(withheld, seq, head_out, empty) -> None:
    """Where withheld[0] > 0: head_out[0] = seq[0] (after everything `post` wrote); else empty += 1."""
    _publish[(1,)](withheld, seq, head_out, empty, num_warps=1, **pdl_launch(seq, _INTERPRETED))


def take_rows(withheld, ok, ids, table, rows, o) -> None:
    """o[p] = rows[p] (float32 [>= P, H]; o [P, H] contiguous) for the pairs p whose expert has no
    slot in `table`, where withheld[0] > 0 and ok[0] != 0."""
    P, H = o.shape
    if P:
        _take_rows[(P,)](withheld, ok, ids, table, rows, o, H, BLOCK_H=min(BLOCK_H, triton.next_power_of_2(H)),
                         num_warps=4, **pdl_launch(o, _INTERPRETED))


def lost_pairs(withheld, ok, ids, table, lookup_out, lost_out, gate_out, lost_count) -> None:
    """Where withheld[0] > 0 and ok[0] == 0, the withheld pairs (table[ids] < 0) are lost: lost_out
    holds their ids (-1 elsewhere), lookup_out their ids and a held pair's id elsewhere, gate_out
    1 where any, lost_count += their number. ids: [P] flat, contiguous."""
    P = ids.numel()
    _lost_pairs[(1,)](withheld, ok, ids, table, P, lookup_out, lost_out, gate_out, lost_count,
                      BLOCK_P=_block(P), num_warps=1, **pdl_launch(ids, _INTERPRETED))


def redo_table(gate, lost, table, redo_out) -> None:
    """redo_out[e] = table[e] for the experts in `lost` where gate[0] != 0, else -1 (int32 [E])."""
    E, P = table.numel(), lost.numel()
    _redo_table[(1,)](gate, lost, table, E, P, redo_out, BLOCK_E=_block(E), BLOCK_P=_block(P), num_warps=4,
                      **pdl_launch(table, _INTERPRETED))


_INTERPRETED = isinstance(_post, InterpretedFunction)  # under Triton's CPU interpreter (tests)
