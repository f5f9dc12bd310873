"""Preallocated KV cache for one sequence, and the token ids whose K/V it holds.

It is the one record of what is cached: `tokens` are the ids at positions 0..length-1, so prefix
reuse and rollback (speculative decoding rejects drafted tokens) only ever ask it."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, *,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, max_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []  # ids whose K/V are stored (all layers), position i at index i

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    @staticmethod
    def nbytes_for(num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * max_tokens * torch.finfo(dtype).bits // 8

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [N_kv, T, D] at positions start.. and return all K/V up to them."""
        end = start + k.shape[1]
        self.keys[layer, :, start:end] = k
        self.values[layer, :, start:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def append(self, ids: list[int]) -> None:
        """Record that the K/V of `ids` (at the next positions) are now stored in every layer."""
        if self.length + len(ids) > self.max_tokens:
            raise ValueError(f"{self.length + len(ids)} tokens exceed the KV cache's {self.max_tokens}")
        self.tokens.extend(ids)

    def truncate(self, length: int) -> None:
        """Forget every position from `length` on (their K/V are overwritten by the next tokens)."""
        del self.tokens[max(0, length):]
