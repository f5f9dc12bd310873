"""Causal self-attention with GQA, RoPE, optional q/k norms and a KV cache (one sequence)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moestream.engine.kv_cache import KVCache
from moestream.layers.norm import rms_norm
from moestream.layers.rope import apply_rope

# cuDNN's attention builds a new plan for every key length, i.e. for every decode step (measured:
# 8 ms of CPU per call on the H200 machine); the flash and memory-efficient kernels need none.
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class AttentionWeights:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    o: torch.Tensor
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    qkv: torch.Tensor | None = None  # [q; k; v] rows in one tensor (q, k, v are views of it): one matmul in decode
    qkv_bias: torch.Tensor | None = None

    def fuse_qkv(self) -> None:
        """Store q, k, v as row blocks of one tensor, so that a decode step projects with one matmul."""
        self.qkv = torch.cat([self.q, self.k, self.v])
        nq, nk = self.q.shape[0], self.k.shape[0]
        self.q, self.k, self.v = self.qkv[:nq], self.qkv[nq:nq + nk], self.qkv[nq + nk:]
        if self.q_bias is not None:
            self.qkv_bias = torch.cat([self.q_bias, self.k_bias, self.v_bias])
            self.q_bias, self.k_bias, self.v_bias = (self.qkv_bias[:nq], self.qkv_bias[nq:nq + nk],
                                                     self.qkv_bias[nq + nk:])


class Attention:
    """qk_norm: "head" (Qwen3: per head over head_dim), "full" (OLMoE: over the whole projection) or None."""

    def __init__(self, weights: AttentionWeights, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm: str | None, eps: float, clip_qkv: float | None = None):
        self.w = weights
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm, self.eps, self.clip_qkv = qk_norm, eps, clip_qkv

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                 start: int) -> torch.Tensor:
        # x [T, H]; cos/sin [T, D]; the chunk occupies positions start .. start+T-1.
        w, T = self.w, x.shape[0]
        q = F.linear(x, w.q, w.q_bias)  # [T, Nq*D]
        k = F.linear(x, w.k, w.k_bias)  # [T, Nkv*D]
        v = F.linear(x, w.v, w.v_bias)
        if self.qk_norm == "full":
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [Nq, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin)  # [Nkv, T, D]
        v = v.view(T, self.num_kv_heads, self.head_dim).transpose(0, 1)
        keys, values = cache.update(layer, start, k, v)  # [Nkv, S, D], S = start + T
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=0)
            values = values.repeat_interleave(groups, dim=0)
        with sdpa_kernel(SDPA_BACKENDS):
            if T == 1:
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None])
            elif start == 0:
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None], is_causal=True)
            else:  # a later prefill chunk: row i sees keys 0 .. start+i
                S = keys.shape[1]
                mask = torch.arange(S, device=x.device)[None, :] <= (start + torch.arange(T, device=x.device))[:, None]
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)
        out = out[0].transpose(0, 1).reshape(T, self.num_heads * self.head_dim)
        return F.linear(out, w.o)

    def decode(self, x: torch.Tensor, pos: torch.Tensor, inv_freq: torch.Tensor, cache: KVCache,
               layer: int) -> torch.Tensor:
        """One token x [1, H] at the device position `pos` [1] on CUDA, in fused Triton kernels that
        read no device value on the host (so a CUDA graph serves every position)."""
        from moestream.kernels import triton_decode as td

        w, nq, nkv = self.w, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        qkv = F.linear(x, w.qkv, w.qkv_bias) if w.qkv is not None else \
            torch.cat([F.linear(x, w.q, w.q_bias), F.linear(x, w.k, w.k_bias), F.linear(x, w.v, w.v_bias)], dim=-1)
        q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        if self.qk_norm == "full":
            q, k = td.rms_norm(q, w.q_norm, self.eps), td.rms_norm(k, w.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        head = self.qk_norm == "head"
        q = td.rope_qk_store(q, k, v, pos, inv_freq, cache.keys[layer], cache.values[layer],
                             q_norm=w.q_norm if head else None, k_norm=w.k_norm if head else None, eps=self.eps)
        return F.linear(td.decode_attention(q, cache.keys[layer], cache.values[layer], pos), w.o)
