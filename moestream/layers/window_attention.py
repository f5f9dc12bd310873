"""GQA attention with its own rotary table and head size per layer, an optional sliding window,
per-head q/k RMSNorm, a scale-free RMSNorm on values, keys reused as values (k_eq_v) and a fixed
score scale (Gemma 4: 1.0, the q/k norms bound the scores).

Legend: T tokens, S cached positions, Nq/Nkv heads, D head size. The cache keeps every position
(a window layer masks the old ones out rather than overwriting them), so rollback and prefix reuse
work as for full attention."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from moestream.layers.attention import SDPA_BACKENDS
from moestream.layers.kv_cache import KVCache
from moestream.layers.norm_f32 import rms_norm_f32
from moestream.layers.rope import Rope, apply_rope


@dataclass
class WindowAttentionWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor | None  # None: values are the keys' projection (before the key norm)
    o: torch.Tensor
    q_norm: torch.Tensor
    k_norm: torch.Tensor


class WindowAttention:
    def __init__(self, weights: WindowAttentionWeights, rope: Rope, *, num_heads: int, num_kv_heads: int,
                 head_dim: int, eps: float, window: int | None, scale: float):
        self.w, self.rope = weights, rope
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.window, self.scale = eps, window, scale

    def _qkv(self, x: torch.Tensor, positions: torch.Tensor):
        """q [Nq, T, D], k, v [Nkv, T, D] for x [T, H] at `positions` [T]."""
        w, T, D = self.w, x.shape[0], self.head_dim
        q = rms_norm_f32(F.linear(x, w.q).view(T, self.num_heads, D), w.q_norm, self.eps)
        k_raw = F.linear(x, w.k).view(T, self.num_kv_heads, D)
        v = k_raw if w.v is None else F.linear(x, w.v).view(T, self.num_kv_heads, D)
        k = rms_norm_f32(k_raw, w.k_norm, self.eps)
        v = rms_norm_f32(v, None, self.eps)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        return apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin), v.transpose(0, 1)

    def _mask(self, q_pos: torch.Tensor, S: int) -> torch.Tensor:
        """[T, S] True where query at q_pos [T] may see key position s: causal, within the window."""
        k_pos = torch.arange(S, device=q_pos.device)[None, :]
        mask = k_pos <= q_pos[:, None]
        if self.window is not None:
            mask &= k_pos > q_pos[:, None] - self.window
        return mask

    def _attend(self, q, keys, values, mask) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            keys, values = keys.repeat_interleave(groups, dim=0), values.repeat_interleave(groups, dim=0)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, scale=self.scale)
        T = q.shape[1]
        return F.linear(out[0].transpose(0, 1).reshape(T, self.num_heads * self.head_dim), self.w.o)

    def __call__(self, x: torch.Tensor, cache: KVCache, layer: int, start: int) -> torch.Tensor:
        """x [T, H] at positions start .. start+T-1 -> [T, H]."""
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        q, k, v = self._qkv(x, positions)
        keys, values = cache.update(layer, start, k, v)  # [Nkv, S, D], S = start + T
        return self._attend(q, keys, values, self._mask(positions, keys.shape[1]))

    def step(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """One token x [1, H] at the device position pos [1]. CPU: __call__. CUDA: torch ops over the
        whole cache with a mask, reading no device value on the host (a CUDA graph serves every
        position); the fused decode kernels assume the default scale and no window."""
        if not x.is_cuda:
            return self(x, cache, layer, int(pos))
        q, k, v = self._qkv(x, pos.view(1))
        cache.keys[layer].index_copy_(1, pos.view(1), k)
        cache.values[layer].index_copy_(1, pos.view(1), v)
        return self._attend(q, cache.keys[layer], cache.values[layer], self._mask(pos.view(1), cache.max_tokens))
