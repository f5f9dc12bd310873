"""Causal self-attention with GQA, RoPE, optional q/k norms and a KV cache (one sequence)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moestream.kernels.reference import rows_exact, rows_linear
from moestream.layers.kv_cache import KVCache
from moestream.layers.norm import rms_norm
from moestream.layers.rope import Rope, apply_rope

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
    o_bias: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [Nq]: a learned logit per head that takes part in the softmax, no value

    def fuse_qkv(self) -> None:
        """Store q, k, v as row blocks of one tensor, so that a decode step projects with one matmul."""
        self.qkv = torch.cat([self.q, self.k, self.v])
        nq, nk = self.q.shape[0], self.k.shape[0]
        self.q, self.k, self.v = self.qkv[:nq], self.qkv[nq:nq + nk], self.qkv[nq + nk:]
        if self.q_bias is not None:
            self.qkv_bias = torch.cat([self.q_bias, self.k_bias, self.v_bias])
            self.q_bias, self.k_bias, self.v_bias = (self.qkv_bias[:nq], self.qkv_bias[nq:nq + nk],
                                                     self.qkv_bias[nq + nk:])


def _fused_kernels():
    """moestream.kernels.triton_decode where Triton is installed, else None (torch ops then)."""
    try:
        from moestream.kernels import triton_decode
    except ImportError:
        return None
    return triton_decode


def visible(query_pos: torch.Tensor, key_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """[T, S] bool: a query sees keys at or before it, and with a sliding window only the last `window`."""
    seen = key_pos[None, :] <= query_pos[:, None]
    if window is not None:
        seen = seen & (key_pos[None, :] > query_pos[:, None] - window)
    return seen


def attend_with_sinks(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor,
                      sinks: torch.Tensor | None) -> torch.Tensor:
    """q [N, T, D], keys/values [N, S, D], mask [T, S] bool -> [N, T, D]. Each head's sink logit joins
    the softmax and is then dropped, so a head may give less than all its weight to the keys."""
    scores = torch.matmul(q, keys.transpose(1, 2)) * q.shape[-1] ** -0.5  # [N, T, S]
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(scores.dtype)[:, None, None].expand(-1, q.shape[1], 1)], dim=-1)
    probs = torch.softmax(scores - scores.amax(dim=-1, keepdim=True), dim=-1)
    return torch.matmul(probs[..., :keys.shape[1]].to(values.dtype), values)


class Attention:
    """qk_norm: "head" (Qwen3: per head over head_dim), "full" (OLMoE: over the whole projection) or None.
    window: a sliding window of that many keys (None: full causal); weights.sinks: per-head sink logits."""

    def __init__(self, weights: AttentionWeights, rope: Rope, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 qk_norm: str | None, eps: float, clip_qkv: float | None = None, window: int | None = None):
        self.w, self.rope = weights, rope
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.qk_norm, self.eps, self.clip_qkv, self.window = qk_norm, eps, clip_qkv, window

    @property
    def plain(self) -> bool:
        """No sinks, no window: SDPA and the fused decode kernels compute it."""
        return self.w.sinks is None and self.window is None

    def _project(self, x: torch.Tensor, norm, fused: bool = False, linear=F.linear
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, Nq*D], k, v [T, Nkv*D] after the full-projection norm and clipping (if any).
        fused: one product over the stacked rows even for T > 1 (a step's fixed-size row tile),
        computed by `linear` (F.linear, or the row tile's kernel: moestream.layers.tile_products)."""
        w = self.w
        if (fused or x.shape[0] == 1) and w.qkv is not None:  # one token: one matmul
            qkv = linear(x, w.qkv, w.qkv_bias)
            nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        else:
            q, k, v = F.linear(x, w.q, w.q_bias), F.linear(x, w.k, w.k_bias), F.linear(x, w.v, w.v_bias)
        if self.qk_norm == "full":
            q, k = norm(q, w.q_norm, self.eps), norm(k, w.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return q, k, v

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: KVCache, layer: int,
                 start: int) -> torch.Tensor:
        # x [T, H]; cos/sin [T, D]; the chunk occupies positions start .. start+T-1.
        w, T = self.w, x.shape[0]
        q, k, v = self._project(x, rms_norm)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [Nq, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin)  # [Nkv, T, D]
        v = v.view(T, self.num_kv_heads, self.head_dim).transpose(0, 1)
        keys, values = cache.update(layer, start, k, v)  # [Nkv, S, D], S = start + T
        if not self.plain:  # the KV cache stays full length; the window is a mask
            groups = self.num_heads // self.num_kv_heads
            if groups > 1:
                keys = keys.repeat_interleave(groups, dim=0)
                values = values.repeat_interleave(groups, dim=0)
            positions = torch.arange(keys.shape[1], device=x.device)
            mask = visible(positions[start:], positions, self.window)
            out = attend_with_sinks(q, keys, values, mask, self.w.sinks)
            return F.linear(out.transpose(0, 1).reshape(T, self.num_heads * self.head_dim), w.o, w.o_bias)
        return self._attend(q, keys, values, start)

    def _attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, start: int) -> torch.Tensor:
        """Plain causal attention of q [Nq, T, D] (positions start..) over keys/values [Nkv or Nq, S, D],
        S = start + T, then the output projection: [T, H]."""
        T = q.shape[1]
        groups = self.num_heads // keys.shape[0]
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
                mask = torch.arange(S, device=q.device)[None, :] <= (start + torch.arange(T, device=q.device))[:, None]
                out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)
        out = out[0].transpose(0, 1).reshape(T, self.num_heads * self.head_dim)
        return F.linear(out, self.w.o, self.w.o_bias)

    def prefill_rows(self, x: torch.Tensor, start: int, cache: KVCache, layer: int) -> torch.Tensor:
        """`__call__` for a prefill chunk x [T, H] (normed) at positions start.. on the decode step's fused
        kernels (`takes_slot`; CUDA): one q/k/v product, then the q/k norms, rotary and K/V write of all
        T rows in one launch (rope_qk_store_rows), then the same attention. Within the dtype's tolerance
        of `__call__` (the kernels reduce in another order), the same for every cache size."""
        td = _fused_kernels()
        if not self.takes_slot() or not (x.is_cuda or td._INTERPRETED):
            raise ValueError("a fused prefill needs CUDA, the fused kernels and plain attention")
        w, T, head = self.w, x.shape[0], self.qk_norm == "head"
        keys, values = cache.keys[layer], cache.values[layer]
        q, k, v = self._project(x, td.rms_norm, fused=True)
        pos = torch.arange(start, start + T, device=x.device)
        q = td.rope_qk_store_rows(q, k, v, pos, self.rope.inv_freq, keys, values, q_norm=w.q_norm if head else None,
                                  k_norm=w.k_norm if head else None, eps=self.eps)  # [T, Nq, D]
        return self._attend(q.transpose(0, 1), keys[:, :start + T], values[:, :start + T], start)

    def takes_slot(self) -> bool:
        """Whether `rows` can run (the fused kernels; each row's sequence slot as a device value)."""
        return self.rope.plain and self.plain and self.w.o_bias is None and _fused_kernels() is not None

    def rows(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int, T: int, *,
             slot: torch.Tensor | None = None, linear=F.linear) -> torch.Tensor:
        """The first T rows of x [R, H] (R >= T, a fixed tile) as T tokens at device positions pos[:T],
        on CUDA with the fused kernels (`takes_slot`): every product over all R rows (a fixed shape,
        so a row's bits never depend on the rows beside it or on T), K/V of all T rows written before
        any row attends, so a later row of a sequence sees the earlier ones. Returns [R, H] (rows
        past T: the product of zeros). slot [T]: each row's sequence slot of the pool `cache` is in.
        linear: the q/k/v and o products' kernel (moestream.layers.tile_products)."""
        if not self.takes_slot() or not (x.is_cuda or _fused_kernels()._INTERPRETED) or \
                (slot is not None and cache.pool is None):
            raise ValueError("a step's rows at once need CUDA, the fused kernels and plain attention")
        w, td, head = self.w, _fused_kernels(), self.qk_norm == "head"
        if slot is None:
            keys, values = cache.keys[layer], cache.values[layer]
        else:
            keys, values = cache.pool[0][:, layer], cache.pool[1][:, layer]
        q, k, v = self._project(x, td.rms_norm, fused=True, linear=linear)
        q = td.rope_qk_store_rows(q[:T], k[:T], v[:T], pos[:T], self.rope.inv_freq, keys, values,
                                  q_norm=w.q_norm if head else None, k_norm=w.k_norm if head else None, eps=self.eps,
                                  slot=slot)
        return linear(td.decode_attention_rows(q, keys, values, pos[:T], out_rows=x.shape[0], slot=slot), w.o)

    def takes_cpu_rows(self, dtype: torch.dtype) -> bool:
        """Whether `cpu_rows` gives every row `step`'s bits: plain attention, q/k/v in one unbiased
        matrix, no output bias, and products `rows_exact` takes."""
        w = self.w
        if not self.plain or not isinstance(self.rope, Rope) or w.qkv is None or w.qkv_bias is not None or \
                w.o_bias is not None:
            return False
        return rows_exact(dtype, w.qkv.shape[1], w.qkv.shape[0]) and rows_exact(dtype, w.o.shape[1], w.o.shape[0])

    def cpu_rows(self, x: torch.Tensor, start: int, cache: KVCache, layer: int) -> torch.Tensor:
        """T tokens x [T, H] (normed) at positions start.. of one sequence on the CPU (`takes_cpu_rows`),
        each row with the bits `step` gives it alone: its products are one-row products batched
        (`rows_linear`), its norms and rotary work row by row alike, and each row attends alone to
        the keys up to its own position, as the row-by-row step does."""
        w, T, D = self.w, x.shape[0], self.head_dim
        qkv = rows_linear(x, w.qkv).view(T, -1)
        nq, nkv = self.num_heads * D, self.num_kv_heads * D
        q, k, v = qkv[:, :nq], qkv[:, nq:nq + nkv], qkv[:, nq + nkv:]
        if self.qk_norm == "full":
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q, k = q.reshape(T, self.num_heads, D), k.reshape(T, self.num_kv_heads, D)
        if self.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        cos, sin = self.rope.rows_cos_sin(start, T, x.dtype)
        q = apply_rope(q.transpose(0, 1), cos, sin)  # [Nq, T, D]
        k = apply_rope(k.transpose(0, 1), cos, sin)  # [Nkv, T, D]
        v = v.reshape(T, self.num_kv_heads, D).transpose(0, 1)
        keys, values = cache.update(layer, start, k, v)  # [Nkv, start + T, D]
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            keys = keys.repeat_interleave(groups, dim=0)
            values = values.repeat_interleave(groups, dim=0)
        out = x.new_empty((T, nq))
        with sdpa_kernel(SDPA_BACKENDS):
            for t in range(T):  # row t sees keys 0 .. start + t
                end = start + t + 1
                a = F.scaled_dot_product_attention(q[None, :, t:t + 1].contiguous(), keys[None, :, :end], values[None, :, :end])
                out[t] = a[0].transpose(0, 1).reshape(nq)
        return rows_linear(out, w.o).view(T, -1)

    def step(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """One token x [1, H] at position `pos` (a one-element tensor on x's device). On CUDA it reads
        no device value on the host (a CUDA graph serves every position): fused Triton kernels, or
        where they are missing, torch ops over the whole cache with a mask. On CPU: __call__."""
        if not x.is_cuda:
            start = int(pos)
            cos, sin = self.rope.cos_sin(pos.view(1), x.dtype)
            return self(x, cos, sin, cache, layer, start)
        td = _fused_kernels() if self.rope.plain and self.plain and self.w.o_bias is None else None
        if td is None:  # no Triton, or a rotary embedding / sinks / a window the fused kernels do not compute
            return self._step_masked(x, pos, cache, layer)
        w = self.w
        q, k, v = self._project(x, td.rms_norm)
        head = self.qk_norm == "head"
        q = td.rope_qk_store(q, k, v, pos, self.rope.inv_freq, cache.keys[layer], cache.values[layer],
                             q_norm=w.q_norm if head else None, k_norm=w.k_norm if head else None, eps=self.eps)
        return F.linear(td.decode_attention(q, cache.keys[layer], cache.values[layer], pos), w.o)

    def _step_masked(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int) -> torch.Tensor:
        """`step` in torch ops only: K/V written at `pos` by index, attention over every cache row
        with the rows after `pos` masked out."""
        w, D = self.w, self.head_dim
        q, k, v = self._project(x, rms_norm)
        q, k = q.view(1, self.num_heads, D), k.view(1, self.num_kv_heads, D)
        if self.qk_norm == "head":
            q, k = rms_norm(q, w.q_norm, self.eps), rms_norm(k, w.k_norm, self.eps)
        cos, sin = self.rope.cos_sin(pos.view(1), x.dtype)
        q, k = apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin)
        cache.keys[layer].index_copy_(1, pos.view(1), k)
        cache.values[layer].index_copy_(1, pos.view(1), v.view(1, self.num_kv_heads, D).transpose(0, 1))
        groups = self.num_heads // self.num_kv_heads
        keys = cache.keys[layer].repeat_interleave(groups, dim=0)
        values = cache.values[layer].repeat_interleave(groups, dim=0)
        mask = visible(pos.view(1), torch.arange(cache.max_tokens, device=x.device), self.window)
        if not self.plain:
            out = attend_with_sinks(q, keys, values, mask, self.w.sinks)
            return F.linear(out.transpose(0, 1).reshape(1, self.num_heads * D), w.o, w.o_bias)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask)
        return F.linear(out[0].transpose(0, 1).reshape(1, self.num_heads * D), w.o, w.o_bias)
