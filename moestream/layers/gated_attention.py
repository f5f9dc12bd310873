"""Full attention with an output gate (Qwen3-Next, Qwen3.5): q_proj gives each head's query and a
gate side by side, the attention output is multiplied by sigmoid(gate) before o_proj; per-head q/k
RMSNorms with zero-centered weights (scale 1 + w), partial rotary; GQA and a KV cache as usual."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from moestream.layers.attention import SDPA_BACKENDS, visible
from moestream.layers.kv_cache import KVCache
from moestream.layers.rope import Rope, apply_rope


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose weight is stored centered on 0: `scale` is 1 + w in float32, applied in float32
    before rounding back to x's dtype (the reference's order)."""
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


@dataclass
class GatedAttentionWeights:
    q: torch.Tensor  # [Nq * 2D, H]: per head, D query rows then D gate rows
    k: torch.Tensor  # [Nkv * D, H]
    v: torch.Tensor  # [Nkv * D, H]
    o: torch.Tensor  # [H, Nq * D]
    q_norm: torch.Tensor  # [D] float32, 1 + w
    k_norm: torch.Tensor  # [D] float32, 1 + w


class GatedAttention:
    def __init__(self, w: GatedAttentionWeights, rope: Rope, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float):
        self.w, self.rope, self.eps = w, rope, eps
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim

    def _project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [T, H] -> q [Nq, T, D], k, v [Nkv, T, D] (normed, rotated), gate [T, Nq * D]."""
        w, T, D = self.w, x.shape[0], self.head_dim
        qg = F.linear(x, w.q).view(T, self.num_heads, 2 * D)
        q, gate = qg[..., :D], qg[..., D:].reshape(T, self.num_heads * D)
        q = offset_rms_norm(q, w.q_norm, self.eps)
        k = offset_rms_norm(F.linear(x, w.k).view(T, self.num_kv_heads, D), w.k_norm, self.eps)
        v = F.linear(x, w.v).view(T, self.num_kv_heads, D).transpose(0, 1)
        return apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin), v, gate

    def _finish(self, out: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """out [1, Nq, T, D] -> [T, H]."""
        T = gate.shape[0]
        out = out[0].transpose(0, 1).reshape(T, self.num_heads * self.head_dim)
        return F.linear(out * torch.sigmoid(gate), self.w.o)

    def _expand(self, t: torch.Tensor) -> torch.Tensor:
        groups = self.num_heads // self.num_kv_heads
        return t.repeat_interleave(groups, dim=0) if groups > 1 else t

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                 start: int) -> torch.Tensor:
        T = x.shape[0]
        q, k, v, gate = self._project(x, cos, sin)
        keys, values = cache.update(layer, start, k, v)  # [Nkv, S, D], S = start + T
        keys, values = self._expand(keys), self._expand(values)
        with sdpa_kernel(SDPA_BACKENDS):
            if T == 1:
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None])
            elif start == 0:
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True)
            else:  # a later chunk: row i sees keys 0 .. start+i
                positions = torch.arange(keys.shape[1], device=x.device)
                mask = visible(positions[start:], positions, None)
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)
        return self._finish(out, gate)

    def step(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """One token at the device position pos [1]. On CUDA no host read of pos (CUDA graphs): K/V
        written by index, attention over every cache row with the rows after pos masked out."""
        if not x.is_cuda:
            cos, sin = self.rope.cos_sin(pos.view(1), x.dtype)
            return self(x, cos, sin, cache, layer, int(pos))
        return self.step_masked(x, pos, cache, layer)

    def step_masked(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """`step` with no host read of pos (the CUDA path; any device computes it)."""
        cos, sin = self.rope.cos_sin(pos.view(1), x.dtype)
        q, k, v, gate = self._project(x, cos, sin)
        cache.keys[layer].index_copy_(1, pos.view(1), k)
        cache.values[layer].index_copy_(1, pos.view(1), v)
        mask = visible(pos.view(1), torch.arange(cache.max_tokens, device=x.device), None)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q[None], self._expand(cache.keys[layer])[None],
                                                 self._expand(cache.values[layer])[None], attn_mask=mask)
        return self._finish(out, gate)
