"""Device-driven streaming: the expert -> slot map lives on the device, and so does the miss path.

When the host tier holds every record (pinned RAM the GPU reads, moestream.experts.uva), the device
looks up each routed expert's slot, picks victims, rewrites the map and pulls the missed records
itself (moestream.kernels.triton_gather): every step is one CUDA graph and the host never waits for
a layer. A slot is read only after the copy into it, in stream order.

Victims (never this call's hits):
  - cycle (default): the slot whose layer has been looked up most often since the slot was last
    used, among equals the one whose layer comes next latest in the cycle of layers; empty slots
    first, ties to the lowest slot. LRU over a shared pool evicts at each layer what the next layers
    are about to ask for: a simulated 48-layer, 128-expert model with uniform routing hits 22.8 %
    at 25 % under LRU and 25.0 % under this rule (docs/PERFORMANCE.md).
  - lru: the least recently used slot (`--cache-policy lru`).

State, all device tensors (N all experts, flat: layer l's expert e at offset[l] + e; S slots; each
[.. + 1] has a scratch entry last, the target of masked-out writes, so every update is a fixed-shape
scatter a graph can hold):
  - table [N + 1] int32: each expert's slot, -1 where not in the pool;
  - owner [S + 1] int64: the flat expert each slot holds (N: none);
  - last_used [S + 1] int64: lru: call count << 20 | expert (unused slots below any use, in slot
    order); cycle: its layer's lookup count at the last use;
  - calls [layers] int64 (cycle): each layer's counted lookups; slot_layer [S + 1] int64 (cycle):
    the layer index of each slot's expert, -1 while empty;
  - host_slot [N] int64: each expert's host tier slot;
  - hits / misses / away [layers] int64 (away: misses withheld for another compute unit, among the
    misses too).
"""
from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch


POLICIES = ("cycle", "lru")
EMPTY_KEY = -(1 << 40)  # cycle: an empty slot's eviction key, below every held slot's
HELD_KEY = 1 << 48  # a key no victim search takes (this call's hits), above every other


class DeviceMapUnavailable(RuntimeError):
    """Device-driven streaming cannot run here (the reason is the message)."""


class DeviceMap:
    # the victim rule's keys, as the Triton lookup takes them (moestream.kernels.triton_slot_map)
    empty_key, held_key = EMPTY_KEY, HELD_KEY

    def __init__(self, pool: torch.Tensor, host_pool: torch.Tensor, host_slots: Mapping[tuple[int, int], int],
                 num_experts: Mapping[int, int], record_bytes: Mapping[int, int], policy: str = "cycle"):
        """pool: the device slots [S, B]; host_pool: the host tier [R, B] as the device reads it (on
        CPU, the host tier itself); host_slots: (layer, expert) -> host tier slot for every expert;
        num_experts / record_bytes: per MoE layer; policy: cycle or lru (the module doc)."""
        if policy not in POLICIES:
            raise ValueError(f"device map policy {policy!r}: choose one of {', '.join(POLICIES)}")
        self.pool, self.host_pool, dev = pool, host_pool, pool.device
        self.policy = policy
        self.layers = sorted(num_experts)
        self.offset, n = {}, 0
        for layer in self.layers:
            self.offset[layer] = n
            n += num_experts[layer]
        self.num_experts, self.total, self.slots = dict(num_experts), n, pool.shape[0]
        self.record_bytes = dict(record_bytes)
        most = max(num_experts.values())
        # a layer's hits are protected, so its misses need other slots (unless every expert has its own)
        if self.slots < min(2 * most, n):
            raise DeviceMapUnavailable(f"the device cache has {self.slots} slots; device-driven streaming needs at "
                                       f"least {min(2 * most, n)} (twice a layer's {most} experts, or all {n})")
        missing = [key for layer in self.layers for key in ((layer, e) for e in range(num_experts[layer]))
                   if key not in host_slots]
        if missing:
            raise DeviceMapUnavailable(f"the host tier lacks {len(missing)} expert records (first: layer "
                                       f"{missing[0][0]} expert {missing[0][1]}); it must hold them all")
        host = [host_slots[(layer, e)] for layer in self.layers for e in range(num_experts[layer])]
        self.host_slot = torch.tensor(host, dtype=torch.int64, device=dev)
        self.table = torch.full((n + 1,), -1, dtype=torch.int32, device=dev)
        self.owner = torch.full((self.slots + 1,), n, dtype=torch.int64, device=dev)
        # unused slots are taken first, in order (distinct stamps below any use: no ties anywhere)
        self.last_used = torch.arange(-self.slots, 1, dtype=torch.int64, device=dev)
        self.last_used[-1] = 0
        self.clock = torch.zeros((), dtype=torch.int64, device=dev)
        self.hits = torch.zeros(len(self.layers), dtype=torch.int64, device=dev)
        self.misses = torch.zeros(len(self.layers), dtype=torch.int64, device=dev)
        self.away = torch.zeros(len(self.layers), dtype=torch.int64, device=dev)  # misses withheld (in misses too)
        self.calls = torch.zeros(len(self.layers), dtype=torch.int64, device=dev)  # cycle: counted lookups per layer
        self.slot_layer = torch.full((self.slots + 1,), -1, dtype=torch.int64, device=dev)  # cycle: -1 while empty
        self._index = {layer: i for i, layer in enumerate(self.layers)}

    def layer_table(self, layer: int) -> torch.Tensor:
        """int32 [E] view of `layer`'s slots (what the expert kernels index with the router's ids)."""
        off = self.offset[layer]
        return self.table[off:off + self.num_experts[layer]]

    def ensure(self, layer: int, ids: torch.Tensor, *, withhold: torch.Tensor | None = None,
               before_copy: Callable[[], None] | None = None, count: bool = True,
               withheld: torch.Tensor | None = None, gate: torch.Tensor | None = None) -> None:
        """Make every expert in `ids` (this layer's, any shape) hold a slot with its record, with device
        ops only (a CUDA graph can hold it). On CUDA one Triton program decides
        (moestream.kernels.triton_slot_map: 49 against 38 tok/s at 25 % on the H200); `decide`
        takes the calls it does not (prefill chunks) and the CPU's.

        withhold: int32 [1] or [2] (a share of the misses in 1/1024ths), or [2 + M + 1] (from the
        third entry: how many to withhold of a call with m misses, m = 0..M): that many of this call's
        misses, the first in expert order, get no slot (moestream.cpu_share computes them); one
        distinct expert always stays. A second entry p > 0 withholds at least one miss every p-th
        lookup (a probe). withheld: int64 [2] receiving the misses withheld and all the misses.
        gate: int32 [1]; where 0 the call does nothing, so a graph can hold a lookup the device
        decides to run. before_copy runs between the decision and the copies. count: add this call
        to the hit and miss counts."""
        decide = self.decide
        if self.pool.device.type == "cuda":
            from moestream.kernels import triton_slot_map

            if triton_slot_map.fits(ids, self.slots):
                decide = functools.partial(triton_slot_map.slot_map, self)
        src, dst, todo = decide(layer, ids, withhold=withhold, count=count, withheld=withheld, gate=gate)
        if before_copy is not None:
            before_copy()
        copy_records(self.host_pool, self.pool, src, dst, todo)

    def decide(self, layer: int, ids: torch.Tensor, *, withhold: torch.Tensor | None = None,
               count: bool = True, withheld: torch.Tensor | None = None,
               gate: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`ensure`'s decision in torch ops (the reference for the Triton program, and the CPU's
        way); returns what the record copy needs (source rows, destination slots, which to copy)."""
        n, S = self.total, self.slots
        expert, _ = torch.sort(ids.reshape(-1).to(torch.int64))
        key = expert + self.offset[layer]
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]  # each distinct expert once
        go = None
        if gate is not None:  # gated off: no expert counts, so nothing below changes anything
            go = gate.reshape(1)[:1] != 0
            first = first & go
        slot = self.table[key].to(torch.int64)
        miss = first & (slot < 0)
        hit = first & (slot >= 0)
        away = torch.zeros_like(miss)
        if withhold is not None:  # the first c misses (expert order) are computed elsewhere
            share = withhold.reshape(-1).to(torch.int64)
            if share.numel() > 2:  # a count per number of misses
                c = share[2:].gather(0, miss.sum().clamp(max=share.numel() - 3).view(1))
            else:
                c = (share[:1] * miss.sum() + 512) >> 10
            if share.numel() > 1:  # a probe every p-th lookup: at least one miss withheld
                p = share[1:2]
                probe = (p > 0) & (torch.remainder(self.clock + 1, p.clamp(min=1)) == 0)
                c = torch.maximum(c, probe.to(torch.int64))
            c = torch.minimum(c, first.sum() - 1)  # one expert of the call always stays
            if withheld is not None:
                withheld.copy_(torch.stack([(miss & (torch.cumsum(miss, 0) <= c)).sum(), miss.sum()]))
            away = miss & (torch.cumsum(miss, 0) <= c)
            miss = miss & ~away
        step = 1 if go is None else go.to(torch.int64).view(())
        self.clock.add_(step)
        li = self._index[layer]
        k = min(key.shape[0], self.num_experts[layer])
        if self.policy == "cycle":
            if count:
                self.calls[li] += step
            now = self.calls[li].expand_as(expert)
            order = self.eviction_keys(li)
            order.scatter_(0, torch.where(hit, slot, S), HELD_KEY)  # this call's hits are no victims
            self.last_used.scatter_(0, torch.where(hit, slot, S), now)
            # ties to the lowest slot (a stable sort), so the r-th victim is well defined
            victims = torch.sort(order[:S], stable=True).indices[:k]
        else:
            # stamps order slots by last use, then (within one call) by expert: strict LRU, no ties
            now = (self.clock << 20) + expert
            self.last_used.scatter_(0, torch.where(hit, slot, S), now)  # this layer's hits are no victims
            victims = torch.topk(self.last_used[:S], k, largest=False).indices  # the first victims first
        rank = (torch.cumsum(miss, 0) - 1).clamp(min=0, max=k - 1)
        new = victims[rank]  # the r-th miss takes the r-th victim
        old = self.owner[new]
        self.table.scatter_(0, torch.where(miss, old, n), torch.full_like(slot, -1, dtype=torch.int32))
        self.table.scatter_(0, torch.where(miss, key, n), new.to(torch.int32))
        self.owner.scatter_(0, torch.where(miss, new, S), key)
        self.last_used.scatter_(0, torch.where(miss, new, S), now)
        self.slot_layer.scatter_(0, torch.where(miss, new, S), torch.full_like(new, li))
        self.owner[S:].fill_(n)  # scratch entries back to neutral (fill_: no host tensor, graph-safe)
        self.table[n:].fill_(-1)
        self.last_used[S:].fill_(0)
        self.slot_layer[S:].fill_(-1)
        src = self.host_slot[key.clamp(max=n - 1)]
        if count:
            self.hits[li] += hit.sum()
            self.misses[li] += miss.sum() + away.sum()
            self.away[li] += away.sum()
        return src, new, miss

    def eviction_keys(self, li: int) -> torch.Tensor:
        """cycle: each slot's eviction key at a lookup of layer index `li` (smallest evicted first;
        [S + 1], the scratch entry last): -(lookups of its layer since its last use * (L + 1) +
        how many layers on its layer comes), EMPTY_KEY where empty."""
        L = len(self.layers)
        lay = self.slot_layer
        skipped = self.calls[lay.clamp(min=0)] - self.last_used
        ahead = torch.remainder(lay - li, L)
        ahead = torch.where(ahead == 0, L, ahead)  # this layer's own slots come next a whole cycle on
        return torch.where(lay < 0, EMPTY_KEY, -(skipped * (L + 1) + ahead))

    @classmethod
    def synthetic(cls, layers, experts: int, slots: int, *, record_bytes: int = 1, device="cpu",
                  policy: str = "cycle") -> "DeviceMap":
        """A map over zeroed records of `record_bytes`, every layer with `experts` experts: the
        decisions without the model (the simulator, the lookup's timing)."""
        keys = [(layer, e) for layer in layers for e in range(experts)]
        host = torch.zeros((len(keys), record_bytes), dtype=torch.uint8, device=device)
        pool = torch.zeros((slots, record_bytes), dtype=torch.uint8, device=device)
        return cls(pool, host, {key: i for i, key in enumerate(keys)}, {layer: experts for layer in layers},
                   {layer: record_bytes for layer in layers}, policy=policy)

    def totals(self) -> tuple[int, int]:
        """(hits, misses) over every layer so far (one sync)."""
        counted = self.counts().values()
        return sum(h for h, _ in counted), sum(m for _, m in counted)

    def counts(self) -> dict[int, tuple[int, int]]:
        """layer -> (hits, misses) so far (reads the device counters: one sync)."""
        hits, misses = self.hits.tolist(), self.misses.tolist()
        return {layer: (hits[i], misses[i]) for i, layer in enumerate(self.layers)}

    @torch.inference_mode()  # the map's tensors are made inside the engine's inference mode
    def reset_counts(self) -> None:
        self.hits.zero_()
        self.misses.zero_()
        self.away.zero_()


def copy_records(source: torch.Tensor, dest: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                 todo: torch.Tensor) -> None:
    """dest[dst[i]] = source[src[i]] where todo[i]: the Triton gather on CUDA, torch on the CPU."""
    if dest.device.type == "cuda":
        from moestream.kernels.triton_gather import gather_records

        gather_records(source, dest, src, dst, todo)
        return
    rows = todo.nonzero().view(-1)
    if rows.numel():
        dest.index_copy_(0, dst[rows], source.index_select(0, src[rows]))
