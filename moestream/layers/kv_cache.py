"""Preallocated KV cache for one sequence, and the token ids whose K/V it holds.

It is the one record of what is cached: `tokens` are the ids at positions 0..length-1, so prefix
reuse and rollback (speculative decoding rejects drafted tokens) only ever ask it.

A family describes its cache per layer (`ModelArgs.kv_layout()` -> [LayerKV]): where every layer
has the same shape, keys/values are one [layers, heads, tokens, dim] tensor; otherwise (other head
sizes per layer, a compressed latent instead of K/V, a layer with no cache) a list with one
[heads, tokens, dim] tensor per layer. `keys[layer]` is that layer's tensor either way.

A recurrent layer (linear attention: LayerKV with a `state` shape) keeps no per-token K/V but a
state that every token updates; `states[layer]` holds it (moestream.layers.recurrent_state), kept
for the last RECENT_STATES lengths and at every `snapshot_every`-th position, so truncation can
return to those lengths (see `truncate`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.layers.recurrent_state import RecurrentState, StateBook


@dataclass(frozen=True)
class LayerKV:
    """One layer's cache: `heads` rows of `k_dim` keys and `v_heads` rows of `v_dim` values per
    token (v_dim 0: no values, e.g. a latent cache; heads 0: no cache at all)."""

    heads: int
    k_dim: int
    v_heads: int = -1  # -1: as many as key heads
    v_dim: int = -1  # -1: as wide as keys
    state: tuple[int, ...] = ()  # a recurrent layer's float32 state (heads, k_dim, v_dim); () for attention
    conv: tuple[int, int] = ()  # a recurrent layer's convolution history (width - 1, channels)

    @property
    def recurrent(self) -> bool:
        return bool(self.state)

    @property
    def value_heads(self) -> int:
        return self.heads if self.v_heads < 0 else self.v_heads

    @property
    def value_dim(self) -> int:
        return self.k_dim if self.v_dim < 0 else self.v_dim

    def bytes_per_token(self, item: int) -> int:
        return (self.heads * self.k_dim + self.value_heads * self.value_dim) * item

    def bytes_for(self, max_tokens: int, item: int) -> int:
        """The layer's cache for max_tokens positions: its per-token K/V, and a recurrent layer's states."""
        if not self.recurrent:
            return self.bytes_per_token(item) * max_tokens
        return RecurrentState.nbytes_for(self.state, self.conv, max_tokens, item)


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, *,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, max_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []  # ids whose K/V are stored (all layers), position i at index i
        self.states: list[RecurrentState | None] = [None] * num_layers
        self.book: StateBook | None = None
        # (keys, values) [S, layers, heads, tokens, dim] when this cache is one slot of a pool (`pooled`)
        self.pool: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def pooled(cls, count: int, layout: list[LayerKV], max_tokens: int, *, dtype: torch.dtype,
               device: torch.device) -> list["KVCache"]:
        """`count` caches for `layout`. Where every layer has the same shape, their keys (and values)
        are the slices of one [count, layers, heads, tokens, dim] tensor: a decode kernel handed the
        pool and a sequence slot as a device value reaches any of them (moestream.kernels.triton_decode),
        so one CUDA graph serves steps whatever sequences their rows come from. Otherwise separate caches."""
        first = layout[0]
        if count < 2 or not (all(spec == first for spec in layout) and first.value_heads == first.heads and
                             first.value_dim == first.k_dim and not first.recurrent):
            return [cls.for_layout(layout, max_tokens, dtype=dtype, device=device) for _ in range(count)]
        shape = (count, len(layout), first.heads, max_tokens, first.k_dim)
        keys = torch.zeros(shape, dtype=dtype, device=device)
        values = torch.zeros(shape, dtype=dtype, device=device)
        caches, pool = [], (keys, values)
        for s in range(count):
            cache = cls.__new__(cls)
            cache.keys, cache.values, cache.max_tokens, cache.tokens = keys[s], values[s], max_tokens, []
            cache.states, cache.book, cache.pool = [None] * len(layout), None, pool
            caches.append(cache)
        return caches

    @classmethod
    def for_layout(cls, layout: list[LayerKV], max_tokens: int, *, dtype: torch.dtype,
                   device: torch.device) -> "KVCache":
        first = layout[0]
        if all(spec == first for spec in layout) and first.value_heads == first.heads and \
                first.value_dim == first.k_dim and not first.recurrent:
            return cls(len(layout), first.heads, first.k_dim, max_tokens, dtype=dtype, device=device)
        cache = cls.__new__(cls)
        cache.keys = [torch.zeros((s.heads, max_tokens, s.k_dim), dtype=dtype, device=device) for s in layout]
        cache.values = [torch.zeros((s.value_heads, max_tokens, s.value_dim), dtype=dtype, device=device)
                        for s in layout]
        cache.max_tokens, cache.tokens, cache.pool = max_tokens, [], None
        book = StateBook(max_tokens) if any(s.recurrent for s in layout) else None
        cache.book = book
        cache.states = [RecurrentState(s.state, s.conv, book, dtype=dtype, device=device) if s.recurrent else None
                        for s in layout]
        return cache

    @staticmethod
    def bytes_for_layout(layout: list[LayerKV], max_tokens: int, dtype: torch.dtype) -> int:
        item = torch.finfo(dtype).bits // 8
        return sum(spec.bytes_for(max_tokens, item) for spec in layout)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values] if isinstance(self.keys, torch.Tensor) else [*self.keys, *self.values]
        tensors += [t for state in self.states if state is not None for t in state.tensors()]
        return sum(t.numel() * t.element_size() for t in tensors)

    @staticmethod
    def nbytes_for(num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * max_tokens * torch.finfo(dtype).bits // 8

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [N_kv, T, D] at positions start.. and return all K/V up to them."""
        end = start + k.shape[1]
        self.keys[layer][:, start:end] = k
        self.values[layer][:, start:end] = v
        return self.keys[layer][:, :end], self.values[layer][:, :end]

    def append(self, ids: list[int]) -> None:
        """Record that the K/V of `ids` (at the next positions) are now stored in every layer."""
        if self.length + len(ids) > self.max_tokens:
            raise ValueError(f"{self.length + len(ids)} tokens exceed the KV cache's {self.max_tokens}")
        if self.book is not None:  # the recurrent layers wrote their states for the new lengths
            self.book.ran(self.length, self.length + len(ids))
        self.tokens.extend(ids)

    def truncate(self, length: int) -> int:
        """Forget every position from `length` on (their K/V are overwritten by the next tokens) and
        return the length kept. With recurrent layers that is the longest length <= `length` whose
        state is kept (one of the last RECENT_STATES, or a snapshot): the caller recomputes the
        tokens after it (Engine.rollback does)."""
        length = max(0, min(length, self.length))
        if self.book is not None:
            length = self.book.restore(length, [s for s in self.states if s is not None])
        del self.tokens[length:]
        return length
