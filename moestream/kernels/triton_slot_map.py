"""The device map's lookup in one Triton program (moestream.experts.device_map.DeviceMap.ensure).

In torch the lookup is ~35 small kernels per MoE layer (sort, gathers, top-k, scatters), ~90 us of
launches in a graph: as much as copying two missed records. Here one program does it all, with
the distinct experts of the call, their slots, the hits' new stamps (written first, so that they
are never victims), the victims (the least recently used slots, one argmin per miss), the
rewritten table / owner / stamps and the hit and miss counts (the victim rule of the map's policy:
its module doc). It writes, per id position, what the record copy needs (source row,
destination slot, whether to copy). Same decisions as the torch version, which the tests check."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.pdl import pdl_launch

MAX_IDS = 64  # ids per call the program takes (decode, short verify steps): it compares all pairs
MAX_SLOTS = 8192  # slots it holds in registers at once


@triton.jit
def _slot_map(ids_ptr, P, offset, table_ptr, owner_ptr, stamp_ptr, host_slot_ptr, clock_ptr, hits_ptr, misses_ptr,
              away_ptr, withhold_ptr, layer_index, S, N, src_ptr, dst_ptr, todo_ptr, withheld_ptr, gate_ptr,
              calls_ptr, slot_layer_ptr, L, EMPTY_KEY, HELD_KEY,
              BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr, WITHHOLD: tl.constexpr, COUNT: tl.constexpr,
              PROBE: tl.constexpr, WITHHELD: tl.constexpr, GATED: tl.constexpr,
              CYCLE: tl.constexpr, TABLE: tl.constexpr, TABLE_TOP: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.arange(0, BLOCK_P)
    valid = i < P
    if GATED:  # gated off: no position counts, no slot is read, the clock stands still
        valid = valid & (tl.load(gate_ptr) != 0)
    expert = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int64)
    key = expert + offset
    # the first position of each distinct expert counts; later repeats ride along
    same = (key[:, None] == key[None, :]) & (i[None, :] < i[:, None]) & valid[None, :]
    first = valid & (tl.sum(same.to(tl.int32), 1) == 0)
    slot = tl.load(table_ptr + key, mask=valid, other=-1).to(tl.int64)
    miss = first & (slot < 0)
    hit = first & (slot >= 0)
    # misses in order of expert (as the torch version assigns victims)
    before = (key[None, :] < key[:, None]) & miss[None, :]
    rank = tl.sum(before.to(tl.int32), 1)
    n_away = 0
    clock = tl.load(clock_ptr) + 1
    if WITHHOLD:  # the first c misses in expert order get no slot (computed elsewhere); one expert stays
        misses = tl.sum(miss.to(tl.int64), 0)
        if TABLE:  # a count per number of misses
            c = tl.load(withhold_ptr + 2 + tl.minimum(misses, TABLE_TOP)).to(tl.int64)
        else:
            c = (tl.load(withhold_ptr).to(tl.int64) * misses + 512) >> 10
        if PROBE:  # every p-th lookup withholds at least one miss (the other unit's speed measured again)
            p = tl.load(withhold_ptr + 1).to(tl.int64)
            c = tl.maximum(c, ((p > 0) & (clock % tl.maximum(p, 1) == 0)).to(tl.int64))
        c = tl.minimum(c, tl.sum(first.to(tl.int64), 0) - 1)
        away = miss & (rank < c)
        n_away = tl.sum(away.to(tl.int32), 0)
        miss = miss & (rank >= c)
        rank = rank - n_away
    if WITHHELD:
        tl.store(withheld_ptr, n_away.to(tl.int64))
        tl.store(withheld_ptr + 1, misses)
    s = tl.arange(0, BLOCK_S)
    live = s < S
    if GATED:
        live = live & (tl.load(gate_ptr) != 0)
    big = 0x7FFFFFFFFFFFFFFF
    if CYCLE:
        calls = tl.load(calls_ptr + layer_index)
        if COUNT:
            calls += 1
            if GATED:
                tl.store(calls_ptr + layer_index, calls, mask=tl.load(gate_ptr) != 0)
            else:
                tl.store(calls_ptr + layer_index, calls)
        now = tl.zeros([BLOCK_P], dtype=tl.int64) + calls
        # this call's hits marked (a stamp no slot has) so that they are never victims; their real
        # stamps are written after the search
        tl.store(stamp_ptr + slot, tl.zeros([BLOCK_P], dtype=tl.int64) - HELD_KEY, mask=hit)
        tl.debug_barrier()  # the count and marks just written are what every thread reads below
        lay = tl.load(slot_layer_ptr + s, mask=live, other=-1)
        last = tl.load(stamp_ptr + s, mask=live, other=0)
        skipped = tl.load(calls_ptr + tl.maximum(lay, 0), mask=live, other=0) - last
        # how far ahead the slot's layer comes, 1..L (itself: L); a compare, not an int64 modulo
        ahead = lay - layer_index
        ahead = tl.where(ahead <= 0, ahead + L, ahead)
        stamps = tl.where(lay < 0, EMPTY_KEY, -(skipped * (L + 1) + ahead))
        stamps = tl.where(last == -HELD_KEY, HELD_KEY, stamps)
        stamps = tl.where(live, stamps, big)
    else:
        now = (clock << 20) + expert
        # this call's hits take the newest stamps first, so they are never victims (as in torch)
        tl.store(stamp_ptr + slot, now, mask=hit)
        tl.debug_barrier()  # the stamps just written are what every thread reads below
        stamps = tl.load(stamp_ptr + s, mask=live, other=big)
    new = tl.zeros([BLOCK_P], dtype=tl.int64)
    n_miss = tl.sum(miss.to(tl.int32), 0)
    r = 0
    while r < n_miss:  # one argmin per miss: the r-th miss takes the r-th least recently used slot
        low = tl.min(stamps, 0)
        victim = tl.min(tl.where(stamps == low, s, BLOCK_S), 0).to(tl.int64)
        new = tl.where(miss & (rank == r), victim, new)
        stamps = tl.where(s == victim, big, stamps)
        r += 1
    old = tl.load(owner_ptr + new, mask=miss, other=N)
    # writes, after every read
    tl.store(table_ptr + old, tl.full([BLOCK_P], -1, tl.int32), mask=miss & (old < N))
    tl.store(table_ptr + key, new.to(tl.int32), mask=miss)
    tl.store(owner_ptr + new, key, mask=miss)
    tl.store(stamp_ptr + new, now, mask=miss)
    tl.store(slot_layer_ptr + new, tl.zeros([BLOCK_P], dtype=tl.int64) + layer_index, mask=miss)
    if CYCLE:
        tl.store(stamp_ptr + slot, now, mask=hit)
    if GATED:
        tl.store(clock_ptr, clock, mask=tl.load(gate_ptr) != 0)
    else:
        tl.store(clock_ptr, clock)
    if COUNT:
        tl.store(hits_ptr + layer_index, tl.load(hits_ptr + layer_index) + tl.sum(hit.to(tl.int64), 0))
        tl.store(misses_ptr + layer_index, tl.load(misses_ptr + layer_index) + (n_miss + n_away).to(tl.int64))
        tl.store(away_ptr + layer_index, tl.load(away_ptr + layer_index) + n_away)
    src = tl.load(host_slot_ptr + tl.minimum(key, N - 1), mask=valid, other=0)
    stored = i < P  # every position, gated or not: the copy reads them all
    tl.store(src_ptr + i, src, mask=stored)
    tl.store(dst_ptr + i, new, mask=stored)
    tl.store(todo_ptr + i, miss.to(tl.int8), mask=stored)


def fits(ids: torch.Tensor, slots: int) -> bool:
    """Whether one program takes this call (else the torch version runs)."""
    return ids.numel() <= MAX_IDS and slots <= MAX_SLOTS


def slot_map(dm, layer: int, ids: torch.Tensor, *, withhold: torch.Tensor | None = None,
             count: bool = True, withheld: torch.Tensor | None = None,
             gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run the lookup of `ids` (this layer's) on `dm`'s state (a DeviceMap, whose `empty_key` and
    `held_key` the victim rule takes); returns (src, dst, todo) per id for the record copy.
    withhold / count / withheld / gate: as DeviceMap.ensure."""
    flat = ids.reshape(-1)
    P, dev = flat.numel(), flat.device
    src = torch.empty(P, dtype=torch.int64, device=dev)
    dst = torch.empty(P, dtype=torch.int64, device=dev)
    todo = torch.empty(P, dtype=torch.int8, device=dev)
    _slot_map[(1,)](flat, P, dm.offset[layer], dm.table, dm.owner, dm.last_used, dm.host_slot, dm.clock, dm.hits,
                    dm.misses, dm.away, withhold if withhold is not None else dm.hits, dm._index[layer], dm.slots,
                    dm.total, src, dst, todo, withheld if withheld is not None else dm.hits,
                    gate if gate is not None else dm.hits, dm.calls, dm.slot_layer, len(dm.layers), dm.empty_key,
                    dm.held_key, BLOCK_P=max(16, triton.next_power_of_2(P)),
                    BLOCK_S=triton.next_power_of_2(dm.slots), WITHHOLD=withhold is not None, COUNT=count,
                    PROBE=withhold is not None and withhold.numel() > 1,
                    WITHHELD=withhold is not None and withheld is not None, GATED=gate is not None,
                    CYCLE=dm.policy == "cycle", TABLE=withhold is not None and withhold.numel() > 2,
                    TABLE_TOP=max(0, withhold.numel() - 3) if withhold is not None else 0,
                    num_warps=8 if dm.slots <= 4096 else 16, **pdl_launch(flat, _INTERPRETED))
    return src, dst, todo


_INTERPRETED = isinstance(_slot_map, InterpretedFunction)  # under Triton's CPU interpreter (tests)
