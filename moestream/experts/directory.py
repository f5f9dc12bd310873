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

_FREE, _LOADING, _READY = 0, 1, 2


class CacheFullError(RuntimeError):
    """Every slot a key may use is pinned or loading, so nothing can be evicted for it."""


@dataclass
class Reservation:
    slot: int
    evicted: Hashable | None  # the key that lived in ``slot`` before, if any


class SlotDirectory:
    """Maps keys to slots, tracks pins and in-flight loads, and picks victims through a policy; one
    pool for all layers, so busy layers borrow slots from quiet ones."""

    def __init__(self, capacity: int, *, policy: str = "clock", **policy_options):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"slot capacity must be a positive int, got {capacity!r}")
        self.capacity, self.policy_name = capacity, policy
        self.policy: ReplacementPolicy = make_policy(policy, capacity, **policy_options)
        self._free = list(range(capacity))  # a heap of free slots: lowest first, so fills are deterministic
        self._key_of: list[Hashable | None] = [None] * capacity
        self._state = bytearray(capacity)
        self._pins = [0] * capacity
        self._slot_of: dict[Hashable, int] = {}
        self._pinned = 0  # slots with a pin count > 0
        self._loading = 0
        self._lock = threading.Lock()

    # -- helpers (caller holds the lock) ---------------------------------------------------------
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

    # -- updates ----------------------------------------------------------------------------------
    def touch(self, key: Hashable) -> None:
        """A use that hit (ready or loading): tell the policy."""
        with self._lock:
            self.policy.hit(self._slot(key))

    def reserve(self, key: Hashable) -> Reservation:
        """Give ``key`` a slot, free first, else a policy victim; the slot is LOADING until
        mark_ready or abort. Raises CacheFullError when every usable slot is pinned or loading."""
        with self._lock:
            if key in self._slot_of:
                raise ValueError(f"{key!r} already has slot {self._slot_of[key]}")
            evicted = None
            if self._free:
                slot = heapq.heappop(self._free)
            else:
                state, pins = self._state, self._pins
                slot = self.policy.evict(key, lambda s: state[s] == _READY and pins[s] == 0)
                if slot is None:
                    raise CacheFullError(self._full_message(key))
                evicted = self._key_of[slot]
                self._release(slot)
            self.policy.admit(slot, key)
            self._key_of[slot] = key
            self._slot_of[key] = slot
            self._state[slot] = _LOADING
            self._loading += 1
            return Reservation(slot, evicted)

    def _full_message(self, key: Hashable) -> str:
        return (f"no slot can be evicted for {key!r}: all {self.capacity} slots are pinned or loading "
                f"({self._pinned} pinned, {self._loading} loading); use a larger expert cache")

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
            self.policy.forget(slot)
            self._release(slot)
            heapq.heappush(self._free, slot)

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
        return (f"SlotDirectory(capacity={self.capacity}, policy={self.policy_name!r}, occupied={len(self._slot_of)}, pinned={self._pinned}, loading={self._loading})")
