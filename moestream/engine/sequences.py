"""The engine's sequence slots over the paged KV pool: which are open, which free slot a new prompt
takes (the one whose cache shares the longest start with it), whether a slot has room for more
tokens and the pool room for one more sequence. Slot 0, the default sequence, is open from the start."""
from __future__ import annotations

import torch

from moestream.engine.types import common_prefix
from moestream.errors import MoestreamError
from moestream.kv.layout import LayerKV
from moestream.kv import pool as kv_pool
from moestream.kv.pool import KVPool, KVRoom, SequenceKV


class PromptTooLongError(MoestreamError):
    pass


class SequenceSlots:
    """`count` sequences of up to `max_context` positions each in one KV pool, and the set of open slots."""

    def __init__(self, layout: list[LayerKV], max_context: int, *, count: int, dtype: torch.dtype,
                 device: torch.device, prefill_chunk: int = 0, num_blocks: int | None = None):
        self.pool = KVPool(layout, max_sequences=count, max_context=max_context, dtype=dtype, device=device,
                           block_size=kv_pool.BLOCK_SIZE, prefill_chunk=prefill_chunk, num_blocks=num_blocks)
        self.caches = self.pool.sequences
        self.max_context = max_context
        self._open = {0}

    def open_cache(self, seq: int) -> SequenceKV:
        """The cache of open slot `seq`, or a clear error."""
        if not isinstance(seq, int) or not 0 <= seq < len(self.caches):
            raise ValueError(f"sequence slot {seq!r} does not exist (slots 0..{len(self.caches) - 1})")
        if seq not in self._open:
            raise ValueError(f"sequence slot {seq} is not open (open_sequence() opens one)")
        return self.caches[seq]

    def check_room(self, n: int, cache: SequenceKV) -> None:
        if cache.length + n > self.max_context:
            raise PromptTooLongError(f"{cache.length + n} tokens exceed the context of {self.max_context}")

    @property
    def open_ids(self) -> list[int]:
        return sorted(self._open)

    def room(self, prompt: list[int], tokens: int, *, share: bool = True) -> KVRoom:
        """Whether a sequence starting with `prompt` and reaching `tokens` positions fits beside the open
        ones, each of which may still grow to the length it was opened for (KVPool.room)."""
        return self.pool.room(prompt, tokens, self.open_ids, share=share)

    def open(self, prefix: list[int] | None = None, *, slot: int | None = None, tokens: int | None = None) -> int:
        """Open a free slot and return its id: `slot`, or with `prefix` (the prompt to come) the one whose
        cache shares the longest start with it, else the lowest; the start it or the pool's published
        blocks hold is kept for prefill. `tokens`: the positions it may reach (default the whole
        context), which `room` keeps free for it."""
        free = [s for s in range(len(self.caches)) if s not in self._open]
        if not free:
            raise MoestreamError(f"all {len(self.caches)} sequence slots are open (max_sequences)")
        if slot is not None and slot not in free:
            raise ValueError(f"sequence slot {slot!r} is not a free slot (free: {free})")
        shared = {s: common_prefix(self.caches[s].tokens, prefix) if prefix else 0 for s in free}
        if slot is None:
            slot = max(free, key=lambda s: (shared[s], -s))
        if prefix:  # its last token is run anew (its logits start decoding): a block shared to its end is
            # copied then, which `room` counts only where this sequence does not hold that token yet
            self.caches[slot].reuse(prefix, len(prefix) - 1)
        else:
            self.caches[slot].truncate(0)
        self.caches[slot].promise = self.max_context if tokens is None else min(tokens, self.max_context)
        self._open.add(slot)
        return slot

    def close(self, seq: int) -> None:
        """Free slot `seq`: its blocks go back to the pool (published ones reusable by any slot), or with
        recurrent layers its tokens and states stay, for a later prompt's prefix in this slot."""
        cache = self.open_cache(seq)
        self._open.discard(seq)
        if not self.pool.recurrent:
            cache.release()
