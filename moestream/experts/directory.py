"""The slot directory: which (layer, expert) key lives in which slot, and which slots may be reused.

Bookkeeping only, no tensors: the cache owns the slot memory and asks the directory where a key
goes; the directory asks a replacement policy for a victim, never offering a pinned slot (a kernel
may be reading it) or a loading one (a read is writing it).
"""
from __future__ import annotations

import heapq
import threading
from dataclasses import dataclass
from typing import Hashable

from moestream.experts.policy import ReplacementPolicy, make_policy

PARTITIONS = ("shared", "per-layer")

_FREE, _LOADING, _READY = 0, 1, 2


class CacheFullError(RuntimeError):
    """Every slot a key may use is pinned or loading, so nothing can be evicted for it."""


@dataclass
class Reservation:
    slot: int
    evicted: Hashable | None  # the key that lived in ``slot`` before, if any


@dataclass
class _Partition:
    """A range of slots with its own policy; "shared" has one over all slots."""

    start: int
    size: int
    policy: ReplacementPolicy
    free: list[int]  # heap of free global slots: lowest first, so fills are deterministic


class SlotDirectory:
    """Maps keys to slots, tracks pins and in-flight loads, and picks victims through a policy.
    ``partition="per-layer"`` gives each layer ``capacity // num_layers`` slots (the rest to the first
    layers) and a policy of its own; ``"shared"`` lets busy layers borrow slots from quiet ones."""

    def __init__(self, capacity: int, *, policy: str = "clock", partition: str = "shared", num_layers: int = 1,
                 **policy_options):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"slot capacity must be a positive int, got {capacity!r}")
        if partition not in PARTITIONS:
            raise ValueError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        self.capacity, self.policy_name, self.partition, self.num_layers = capacity, policy, partition, num_layers
        if partition == "shared":
            sizes = [capacity]
        else:
            if capacity < num_layers:
                raise ValueError(f"per-layer partition needs at least one slot per layer: "
                                 f"{capacity} slots for {num_layers} layers")
            base, extra = divmod(capacity, num_layers)
            sizes = [base + (1 if i < extra else 0) for i in range(num_layers)]
        self._parts: list[_Partition] = []
        start = 0
        for size in sizes:
            free = list(range(start, start + size))  # already a valid heap
            self._parts.append(_Partition(start, size, make_policy(policy, size, **policy_options), free))
            start += size
        self._key_of: list[Hashable | None] = [None] * capacity
        self._state = bytearray(capacity)
        self._pins = [0] * capacity
        self._slot_of: dict[Hashable, int] = {}
        self._pinned = 0  # slots with a pin count > 0
        self._loading = 0
        self._lock = threading.Lock()

    # -- helpers (caller holds the lock) ---------------------------------------------------------
    def _part_for(self, key: Hashable) -> _Partition:
        if self.partition == "shared":
            return self._parts[0]
        layer = key[0]  # type: ignore[index]
        if not 0 <= layer < self.num_layers:
            raise ValueError(f"key {key!r}: layer {layer} out of range [0, {self.num_layers})")
        return self._parts[layer]

    def _slot(self, key: Hashable) -> int:
        slot = self._slot_of.get(key)
        if slot is None:
            raise KeyError(f"{key!r} is not in the slot directory")
        return slot

    def _release(self, slot: int) -> None:
        """Empty ``slot`` in the directory's own tables (the policy is updated by the caller)."""
        del self._slot_of[self._key_of[slot]]
        self._key_of[slot] = None
        if self._state[slot] == _LOADING:
            self._loading -= 1
        self._state[slot] = _FREE
        if self._pins[slot]:
            self._pinned -= 1
            self._pins[slot] = 0

    # -- queries ----------------------------------------------------------------------------------
    def lookup(self, key: Hashable) -> int | None:
        """The slot holding ``key`` (ready or loading), or None. Counts nothing."""
        with self._lock:
            return self._slot_of.get(key)

    def is_loading(self, key: Hashable) -> bool:
        with self._lock:
            return self._state[self._slot(key)] == _LOADING

    def pinned_count(self) -> int:
        with self._lock:
            return self._pinned

    def loading_count(self) -> int:
        with self._lock:
            return self._loading

    def occupied(self) -> int:
        with self._lock:
            return len(self._slot_of)

    def keys(self) -> dict[Hashable, int]:
        """Snapshot of key -> slot for every ready or loading key."""
        with self._lock:
            return dict(self._slot_of)

    @property
    def policies(self) -> tuple[ReplacementPolicy, ...]:
        """One policy per partition (one when shared), for inspection."""
        return tuple(part.policy for part in self._parts)

    def layer_slots(self, layer: int) -> range:
        """The global slots ``layer`` may use: all of them when shared."""
        part = self._parts[0] if self.partition == "shared" else self._parts[layer]
        return range(part.start, part.start + part.size)

    # -- updates ----------------------------------------------------------------------------------
    def touch(self, key: Hashable) -> None:
        """A use that hit (ready or loading): tell the policy."""
        with self._lock:
            slot = self._slot(key)
            part = self._part_for(key)
            part.policy.hit(slot - part.start)

    def reserve(self, key: Hashable) -> Reservation:
        """Give ``key`` a slot, free first, else a policy victim; the slot is LOADING until
        mark_ready or abort. Raises CacheFullError when every usable slot is pinned or loading."""
        with self._lock:
            if key in self._slot_of:
                raise ValueError(f"{key!r} already has slot {self._slot_of[key]}")
            part = self._part_for(key)
            evicted = None
            if part.free:
                slot = heapq.heappop(part.free)
            else:
                start, state, pins = part.start, self._state, self._pins

                def can_evict(local: int) -> bool:
                    g = start + local
                    return state[g] == _READY and pins[g] == 0

                local = part.policy.evict(key, can_evict)
                if local is None:
                    raise CacheFullError(self._full_message(key, part))
                slot = start + local
                evicted = self._key_of[slot]
                self._release(slot)
            part.policy.admit(slot - part.start, key)
            self._key_of[slot] = key
            self._slot_of[key] = slot
            self._state[slot] = _LOADING
            self._loading += 1
            return Reservation(slot, evicted)

    def _full_message(self, key: Hashable, part: _Partition) -> str:
        slots = range(part.start, part.start + part.size)
        pinned = sum(1 for s in slots if self._pins[s])
        loading = sum(1 for s in slots if self._state[s] == _LOADING)
        where = "all" if self.partition == "shared" else f"layer {key[0]}'s"  # type: ignore[index]
        return (f"no slot can be evicted for {key!r}: {where} {part.size} slots are pinned or loading "
                f"({pinned} pinned, {loading} loading); use a larger expert cache")

    def mark_ready(self, key: Hashable) -> None:
        """The load into ``key``'s slot finished; the slot may now be evicted when unpinned."""
        with self._lock:
            slot = self._slot(key)
            if self._state[slot] != _LOADING:
                raise ValueError(f"{key!r} is not loading")
            self._state[slot] = _READY
            self._loading -= 1

    def abort(self, key: Hashable) -> None:
        """The load failed: the slot becomes free (its pins go with it) and ``key`` is unknown."""
        with self._lock:
            slot = self._slot(key)
            if self._state[slot] != _LOADING:
                raise ValueError(f"{key!r} is not loading")
            part = self._part_for(key)
            part.policy.forget(slot - part.start)
            self._release(slot)
            heapq.heappush(part.free, slot)

    def pin(self, key: Hashable) -> None:
        """Keep ``key``'s slot from being evicted until a matching unpin (pins count)."""
        with self._lock:
            slot = self._slot(key)
            if self._pins[slot] == 0:
                self._pinned += 1
            self._pins[slot] += 1

    def unpin(self, key: Hashable) -> None:
        with self._lock:
            slot = self._slot(key)
            if self._pins[slot] == 0:
                raise ValueError(f"{key!r} is not pinned")
            self._pins[slot] -= 1
            if self._pins[slot] == 0:
                self._pinned -= 1

    def __repr__(self) -> str:
        return (f"SlotDirectory(capacity={self.capacity}, policy={self.policy_name!r}, partition={self.partition!r}, "
                f"occupied={len(self._slot_of)}, pinned={self._pinned}, loading={self._loading})")
