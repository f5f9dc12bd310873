"""Replacement policies for a fixed pool of expert slots.

Pure Python, free of package imports: the slot cache, the host tier and the simulator share one
implementation. A policy knows slots (ints in ``[0, capacity)``), not where their bytes live; the
caller says which may be evicted now (not pinned or loading ones) through ``can_evict``.
"""
from __future__ import annotations

import abc
import math
from collections import OrderedDict
from typing import Callable, Hashable


class ReplacementPolicy(abc.ABC):
    """Chooses which occupied slot to give up when a new key needs one."""

    name: str = ""
    options: tuple[str, ...] = ()  # keyword options make_policy accepts for this policy

    def __init__(self, capacity: int):
        if not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"policy capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity

    @abc.abstractmethod
    def hit(self, slot: int) -> None:
        """The key in ``slot`` was used again."""

    @abc.abstractmethod
    def admit(self, slot: int, key: Hashable) -> None:
        """``slot`` now holds ``key`` (a miss filled it); an earlier occupant is dropped."""

    @abc.abstractmethod
    def evict(self, incoming_key: Hashable, can_evict: Callable[[int], bool]) -> int | None:
        """Pick an occupied slot with ``can_evict(slot)`` true, stop tracking it and return it (None if
        there is none). ``incoming_key`` is the key the slot is wanted for (ARC's ghost lists)."""

    @abc.abstractmethod
    def forget(self, slot: int) -> None:
        """``slot`` was emptied from outside (failed load, invalidation); no-op if untracked."""

    @abc.abstractmethod
    def __contains__(self, slot: object) -> bool:
        """Whether ``slot`` is tracked as occupied."""

    @abc.abstractmethod
    def __len__(self) -> int:
        """Number of occupied slots tracked."""

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.capacity:
            raise ValueError(f"slot {slot} out of range [0, {self.capacity})")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(capacity={self.capacity}, occupied={len(self)})"


class ClockPolicy(ReplacementPolicy):
    """CLOCK: close to LRU's hit rate for one bit per slot and no list update on a hit."""

    name = "clock"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.hand = 0
        self._ref = bytearray(capacity)
        self._occupied = bytearray(capacity)
        self._count = 0

    def referenced(self, slot: int) -> bool:
        """The slot's reference bit (for inspection and tests)."""
        return bool(self._ref[slot])

    def hit(self, slot: int) -> None:
        self._check_slot(slot)
        if self._occupied[slot]:
            self._ref[slot] = 1

    def admit(self, slot: int, key: Hashable) -> None:
        self._check_slot(slot)
        if not self._occupied[slot]:
            self._occupied[slot] = 1
            self._count += 1
        self._ref[slot] = 1

    def evict(self, incoming_key: Hashable, can_evict: Callable[[int], bool]) -> int | None:
        # The first sweep clears every evictable slot's bit, so the second must find a victim if
        # one exists: two sweeps bound the loop. Non-evictable slots keep their bit.
        n = self.capacity
        occupied, ref = self._occupied, self._ref
        hand = self.hand
        for _ in range(2 * n):
            s = hand
            hand = hand + 1 if hand + 1 < n else 0
            if not occupied[s] or not can_evict(s):
                continue
            if ref[s]:
                ref[s] = 0
                continue
            self.hand = hand
            occupied[s] = 0
            self._count -= 1
            return s
        self.hand = hand
        return None

    def forget(self, slot: int) -> None:
        self._check_slot(slot)
        if self._occupied[slot]:
            self._occupied[slot] = 0
            self._ref[slot] = 0
            self._count -= 1

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self.capacity and bool(self._occupied[slot])

    def __len__(self) -> int:
        return self._count


class LRUPolicy(ReplacementPolicy):
    """Least recently used: the baseline the others are measured against."""

    name = "lru"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self._order: OrderedDict[int, None] = OrderedDict()  # oldest first

    def hit(self, slot: int) -> None:
        if slot in self._order:
            self._order.move_to_end(slot)

    def admit(self, slot: int, key: Hashable) -> None:
        self._check_slot(slot)
        self._order[slot] = None
        self._order.move_to_end(slot)

    def evict(self, incoming_key: Hashable, can_evict: Callable[[int], bool]) -> int | None:
        for slot in self._order:
            if can_evict(slot):
                del self._order[slot]
                return slot
        return None

    def forget(self, slot: int) -> None:
        self._order.pop(slot, None)

    def order(self) -> list[int]:
        """Occupied slots, least recently used first (for inspection and tests)."""
        return list(self._order)

    def __contains__(self, slot: object) -> bool:
        return slot in self._order

    def __len__(self) -> int:
        return len(self._order)


_MISSING = object()


class ARCPolicy(ReplacementPolicy):
    """Adaptive Replacement Cache (Megiddo & Modha): resists one-time scans, adapts recency vs frequency.
    ``t1``/``t2`` map slot -> key (seen once recently / at least twice), ``b1``/``b2`` hold the keys
    recently evicted from each, all oldest first; ``p`` is the target size of ``t1``."""

    name = "arc"

    def __init__(self, capacity: int):
        super().__init__(capacity)
        self.p = 0.0
        self.t1: OrderedDict[int, Hashable] = OrderedDict()
        self.t2: OrderedDict[int, Hashable] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()
        # evict() adapts p for the incoming key before choosing; admit() commits that value, so
        # the adaptation uses the ghost sizes before the victim joined a ghost list, as in ARC.
        self._pending: tuple[Hashable, float] | None = None

    def _adapted_p(self, key: Hashable) -> float:
        b1, b2 = len(self.b1), len(self.b2)
        if key in self.b1:
            return min(float(self.capacity), self.p + max(1.0, b2 / b1))
        if key in self.b2:
            return max(0.0, self.p - max(1.0, b1 / b2))
        return self.p

    def hit(self, slot: int) -> None:
        if slot in self.t1:
            self.t2[slot] = self.t1.pop(slot)
        elif slot in self.t2:
            self.t2.move_to_end(slot)

    def admit(self, slot: int, key: Hashable) -> None:
        self._check_slot(slot)
        self.forget(slot)
        if key in self.b1 or key in self.b2:
            pending = self._pending
            self.p = pending[1] if pending is not None and pending[0] == key else self._adapted_p(key)
            self.b1.pop(key, None)
            self.b2.pop(key, None)
            self.t2[slot] = key  # a ghost hit means the key was wanted twice: frequency list
        else:
            self.t1[slot] = key
        self._pending = None
        self._trim_ghosts()

    def _trim_ghosts(self) -> None:
        c = self.capacity
        while self.b1 and len(self.t1) + len(self.b1) > c:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * c:
            (self.b2 or self.b1).popitem(last=False)

    def evict(self, incoming_key: Hashable, can_evict: Callable[[int], bool]) -> int | None:
        p = self._adapted_p(incoming_key)
        self._pending = (incoming_key, p)
        n1 = len(self.t1)
        from_t1 = n1 > 0 and (n1 > p or (n1 == p and incoming_key in self.b2))
        lists = [(self.t1, self.b1), (self.t2, self.b2)]
        if not from_t1:
            lists.reverse()
        for resident, ghosts in lists:
            for slot in resident:
                if can_evict(slot):
                    ghosts[resident.pop(slot)] = None
                    return slot
        self._pending = None
        return None

    def forget(self, slot: int) -> None:
        if self.t1.pop(slot, _MISSING) is _MISSING:
            self.t2.pop(slot, None)

    def __contains__(self, slot: object) -> bool:
        return slot in self.t1 or slot in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)


class LFUPolicy(ReplacementPolicy):
    """Least frequently used with exponential decay, so experts popular long ago age out.

    Each hit or admit adds 1 to the key's score; all scores halve every ``half_life`` accesses
    (counted globally), kept as ``log2(score) + time / half_life`` so that no access touches every
    slot. A key's score outlives its eviction and comes back with it: when the pool is smaller than
    the keys one token touches (every recency policy then hits nothing), the often-routed experts
    keep their slots and the rest pass through the least valuable ones.
    """

    name = "lfu"
    options = ("half_life",)

    def __init__(self, capacity: int, *, half_life: float = 1024.0):
        super().__init__(capacity)
        if not half_life > 0:
            raise ValueError(f"lfu half_life must be > 0 accesses, got {half_life!r}")
        self.half_life = float(half_life)
        self.now = 0  # global access count
        self._score: list[float | None] = [None] * capacity  # decayed score as of _last[slot]
        self._last = [0] * capacity
        self._rank = [0.0] * capacity
        self._count = 0
        self._key: list[Hashable] = [None] * capacity
        self._history: dict[Hashable, tuple[float, int]] = {}  # evicted key -> (score, time it left)

    def score(self, slot: int) -> float:
        """The slot's decayed score at the current time (0 if empty)."""
        s = self._score[slot]
        if s is None:
            return 0.0
        return s * 2.0 ** ((self._last[slot] - self.now) / self.half_life)

    def _set(self, slot: int, score: float) -> None:
        self._score[slot] = score
        self._last[slot] = self.now
        self._rank[slot] = math.log2(score) + self.now / self.half_life

    def hit(self, slot: int) -> None:
        self._check_slot(slot)
        if self._score[slot] is not None:
            self.now += 1
            self._set(slot, self.score(slot) + 1.0)

    def admit(self, slot: int, key: Hashable) -> None:
        self._check_slot(slot)
        if self._score[slot] is None:
            self._count += 1
        self.now += 1
        past = self._history.pop(key, None)
        earlier = past[0] * 2.0 ** ((past[1] - self.now) / self.half_life) if past else 0.0
        self._key[slot] = key
        self._set(slot, earlier + 1.0)

    def evict(self, incoming_key: Hashable, can_evict: Callable[[int], bool]) -> int | None:
        best = None
        best_order = None
        scores, rank, last = self._score, self._rank, self._last
        for slot in range(self.capacity):
            if scores[slot] is None or not can_evict(slot):
                continue
            order = (rank[slot], last[slot])
            if best_order is None or order < best_order:
                best, best_order = slot, order
        if best is not None:
            self.forget(best)
        return best

    def forget(self, slot: int) -> None:
        self._check_slot(slot)
        if self._score[slot] is not None:
            if self._key[slot] is not None:
                self._history[self._key[slot]] = (self.score(slot), self.now)
            self._score[slot] = None
            self._key[slot] = None
            self._count -= 1

    def __contains__(self, slot: object) -> bool:
        return isinstance(slot, int) and 0 <= slot < self.capacity and self._score[slot] is not None

    def __len__(self) -> int:
        return self._count


_POLICIES: dict[str, type[ReplacementPolicy]] = {cls.name: cls for cls in (ClockPolicy, LRUPolicy, ARCPolicy, LFUPolicy)}
POLICY_NAMES = tuple(_POLICIES)


def make_policy(name: str, capacity: int, **options) -> ReplacementPolicy:
    """Build the policy called ``name``; options are passed to it (e.g. ``half_life`` for lfu)."""
    cls = _POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown replacement policy {name!r}; choose one of {', '.join(POLICY_NAMES)}")
    unknown = sorted(set(options) - set(cls.options))
    if unknown:
        accepted = ", ".join(cls.options) or "none"
        raise ValueError(f"policy {name!r} does not take option(s) {unknown}; it takes: {accepted}")
    return cls(capacity, **options)
