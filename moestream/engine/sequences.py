"""The engine's sequence slots: one KV cache per slot, and which slots are open.

Kept apart from the engine because it is bookkeeping, not computation: which slot a sequence
runs in, which free slot a new prompt should take (the one whose cache shares the longest start
with it, so prefill reuses that start), and whether a slot has room for more tokens. Slot 0, the
default sequence, is open from the start."""
from __future__ import annotations

import torch

from moestream.engine.types import common_prefix
from moestream.errors import MoestreamError
from moestream.layers.kv_cache import KVCache, LayerKV


class PromptTooLongError(MoestreamError):
    pass


class SequenceSlots:
    """`count` KV caches of `max_context` positions each, and the set of open slots."""

    def __init__(self, layout: list[LayerKV], max_context: int, *, count: int, dtype: torch.dtype,
                 device: torch.device):
        # every slot's cache exists from the start: CUDA graphs bind to it, and the ledger counts it
        # one pool where the layout allows: a decode kernel reaches any sequence's cache by its slot
        self.caches = KVCache.pooled(count, layout, max_context, dtype=dtype, device=device)
        self.max_context = max_context
        self._open = {0}

    def open_cache(self, seq: int) -> KVCache:
        """The KV cache of open slot `seq`, or a clear error."""
        if not isinstance(seq, int) or not 0 <= seq < len(self.caches):
            raise ValueError(f"sequence slot {seq!r} does not exist (slots 0..{len(self.caches) - 1})")
        if seq not in self._open:
            raise ValueError(f"sequence slot {seq} is not open (open_sequence() opens one)")
        return self.caches[seq]

    def check_room(self, n: int, cache: KVCache) -> None:
        if cache.length + n > self.max_context:
            raise PromptTooLongError(f"{cache.length + n} tokens exceed the context of {self.max_context}")

    @property
    def open_ids(self) -> list[int]:
        return sorted(self._open)

    def open(self, prefix: list[int] | None = None, *, slot: int | None = None) -> int:
        """Open a free slot and return its id. With `prefix` (the prompt to come), the free slot
        whose cache shares the longest start with it, that start kept (prefill reuses it); else
        the lowest free slot, emptied. `slot` names the free slot to open (a caller's own choice,
        e.g. the least recently used); its shared start with `prefix` is kept the same way."""
        free = [s for s in range(len(self.caches)) if s not in self._open]
        if not free:
            raise MoestreamError(f"all {len(self.caches)} sequence slots are open (max_sequences)")
        if slot is not None and slot not in free:
            raise ValueError(f"sequence slot {slot!r} is not a free slot (free: {free})")
        shared = {s: common_prefix(self.caches[s].tokens, prefix) if prefix else 0 for s in free}
        if slot is None:
            slot = max(free, key=lambda s: (shared[s], -s))
        self.caches[slot].truncate(shared[slot])
        self._open.add(slot)
        return slot

    def close(self, seq: int) -> None:
        """Free slot `seq` (its cached tokens stay, for a later prompt's prefix)."""
        self.open_cache(seq)
        self._open.discard(seq)
