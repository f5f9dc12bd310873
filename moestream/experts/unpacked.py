"""Unpacked copies of the experts in the slot pool (CPU): a step multiplies instead of unpacking.

The torch reference dequantizes every expert it computes (on the demo model 40 % of a CPU decode).
This keeps recently computed experts' dequantized matrices, keyed by their slot, least recently used
first out. An entry is valid while its slot holds the same (layer, expert), so the bits never change;
its capacity is at most the pool's slots, so the cache size keeps its meaning."""
from __future__ import annotations

from collections import OrderedDict
from typing import Callable


class UnpackedExperts:
    def __init__(self, capacity: int, *, entry_bytes: int = 0):
        """capacity: experts kept at most (0 keeps none); entry_bytes: one expert's unpacked bytes (stats)."""
        self.capacity, self.entry_bytes = capacity, entry_bytes
        # slot -> (layer, expert, matrices): one entry a slot (the pool is one tensor for all layers)
        self._entries: OrderedDict[int, tuple[int, int, tuple]] = OrderedDict()
        self.hits = self.misses = 0

    def get(self, layer: int, expert: int, slot: int, unpack: Callable[[], tuple]) -> tuple:
        """The expert's unpacked matrices: kept ones while `slot` (an index into the one pool all
        layers share) still holds (layer, expert), else unpack()."""
        entry = self._entries.get(slot)
        if entry is not None and entry[0] == layer and entry[1] == expert:
            self._entries.move_to_end(slot)
            self.hits += 1
            return entry[2]
        matrices = unpack()
        self.misses += 1
        if self.capacity > 0:
            self._entries[slot] = (layer, expert, matrices)
            self._entries.move_to_end(slot)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
        return matrices

    def stats(self) -> dict:
        return {"unpacked_experts": len(self._entries), "unpacked_capacity": self.capacity,
                "unpacked_bytes": len(self._entries) * self.entry_bytes,
                "unpacked_hits": self.hits, "unpacked_misses": self.misses}
