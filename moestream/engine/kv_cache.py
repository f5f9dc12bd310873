"""Preallocated KV cache for one sequence; can be cut back to a prefix for reuse."""
from __future__ import annotations

import torch


class KVCache:
    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, *,
                 dtype: torch.dtype, device: torch.device):
        shape = (num_layers, num_kv_heads, max_tokens, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype, device=device)
        self.values = torch.zeros(shape, dtype=dtype, device=device)
        self.max_tokens = max_tokens
        self.length = 0  # tokens whose K/V are stored (all layers)

    @staticmethod
    def nbytes_for(num_layers: int, num_kv_heads: int, head_dim: int, max_tokens: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * max_tokens * torch.finfo(dtype).bits // 8

    def update(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [N_kv, T, D] at positions start.. and return all K/V up to them."""
        end = start + k.shape[1]
        self.keys[layer, :, start:end] = k
        self.values[layer, :, start:end] = v
        return self.keys[layer, :, :end], self.values[layer, :, :end]

    def truncate(self, length: int) -> None:
        self.length = min(self.length, length)
