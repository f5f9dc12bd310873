"""Multi-head latent attention (DeepSeek-V2/V3): the KV cache holds, per token, one compressed
latent [kv_lora_rank] and one rotary key [rope_dim] shared by all heads, not per-head K/V.

`forward` uses the absorbed form: the query's nope part is taken into latent space through kv_b's
key rows, attention runs over the cached rows themselves, and the result leaves latent space
through kv_b's value rows. The plain form (each head's key and value expanded from the latent
through kv_b, `attend_expanded`) agrees to rounding (checked in the tests)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from moestream.kv.layout import LayerKV
from moestream.kv.pool import MAX_STEP_TOKENS, LayerCache
from moestream.layers.norm import rms_norm
from moestream.layers.rope import Rope, apply_rope, apply_rope_interleaved


# cuDNN's attention builds a new plan for every key length; the flash and memory-efficient kernels need none
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


@dataclass
class MLAWeights:
    kv_a: torch.Tensor  # [R + Dr, H]: latent and rotary key
    kv_a_norm: torch.Tensor  # [R]
    kv_b: torch.Tensor  # [N * (Dn + Dv), R]: per head, nope key rows then value rows
    o: torch.Tensor  # [H, N * Dv]
    q: torch.Tensor | None = None  # [N * (Dn + Dr), H] where there is no query low-rank
    q_a: torch.Tensor | None = None  # [Rq, H]
    q_a_norm: torch.Tensor | None = None  # [Rq]
    q_b: torch.Tensor | None = None  # [N * (Dn + Dr), Rq]
    q_a_bias: torch.Tensor | None = None
    kv_a_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None


@dataclass(frozen=True)
class MLAShape:
    num_heads: int  # N
    kv_lora_rank: int  # R
    nope_dim: int  # Dn: the key dimensions without rotary
    rope_dim: int  # Dr: the rotary key dimensions (one key shared by all heads)
    v_dim: int  # Dv

    def cache_layout(self) -> LayerKV:
        """One row of latent + rotary key per token, no values."""
        return LayerKV(1, self.kv_lora_rank + self.rope_dim, v_heads=0, v_dim=0)


class MLAttention:
    """Legend: T tokens, S cached positions, N heads, H hidden, R latent, Dn/Dr/Dv as in MLAShape.
    `scale`: the softmax scale (1/sqrt(Dn + Dr), times YaRN's where the config asks); `interleaved`:
    rotary on adjacent pairs (DeepSeek's rope_interleave) instead of halves."""

    def __init__(self, weights: MLAWeights, rope: Rope, shape: MLAShape, *, scale: float, eps: float,
                 interleaved: bool):
        self.w, self.rope, self.shape = weights, rope, shape
        self.scale, self.eps, self.interleaved = scale, eps, interleaved
        s = shape
        kv_b = weights.kv_b.view(s.num_heads, s.nope_dim + s.v_dim, s.kv_lora_rank)
        self.k_up, self.v_up = kv_b[:, :s.nope_dim], kv_b[:, s.nope_dim:]  # [N, Dn, R], [N, Dv, R] (views)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return apply_rope_interleaved(x, cos, sin) if self.interleaved else apply_rope(x, cos, sin)

    def _query(self, x: torch.Tensor, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> the nope query [N, T, Dn] and the rotated query [N, T, Dr]."""
        w, s, T = self.w, self.shape, x.shape[0]
        if w.q is not None:
            q = F.linear(x, w.q)
        else:
            q = F.linear(rms_norm(F.linear(x, w.q_a, w.q_a_bias), w.q_a_norm, self.eps), w.q_b)
        q = q.view(T, s.num_heads, s.nope_dim + s.rope_dim).transpose(0, 1)
        return q[..., :s.nope_dim], self._rope(q[..., s.nope_dim:], cos, sin)

    def _latent(self, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """x [T, H] -> the cache rows [1, T, R + Dr]: the normed latent, then the rotated key."""
        w, R = self.w, self.shape.kv_lora_rank
        kv = F.linear(x, w.kv_a, w.kv_a_bias)  # [T, R + Dr]
        latent = rms_norm(kv[:, :R], w.kv_a_norm, self.eps)
        k_rot = self._rope(kv[None, :, R:], cos, sin)  # [1, T, Dr]
        return torch.cat((latent[None], k_rot), dim=-1)

    def _out(self, out: torch.Tensor) -> torch.Tensor:
        """[N, T, Dv] -> [T, H]."""
        T = out.shape[1]
        return F.linear(out.transpose(0, 1).reshape(T, -1), self.w.o, self.w.o_bias)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                linear=None) -> torch.Tensor:
        """x [R, H] (normed), positions and sequences [T] -> [R, H], the absorbed form over the latent rows
        in the pool's blocks. On the CPU row by row (a row's bits never depend on the rows beside it);
        on CUDA with no host read, the paged kernels over the latent rows (values: their latent part, a
        view of the same blocks): decode's for a step's rows, prefill's for a chunk's."""
        T = positions.shape[0]
        if not x.is_cuda:
            return torch.cat([self._row(x[t:t + 1], positions[t:t + 1], sequences[t:t + 1], kv) for t in range(T)])
        # the products over all R rows (a step's fixed tile: a row's bits never depend on T)
        rows = torch.cat([positions, positions.new_zeros(x.shape[0] - T)])
        cos, sin = self.rope.cos_sin(rows, x.dtype)
        q_nope, q_rot = self._query(x, cos, sin)
        kv.write(positions, sequences, self._latent(x, cos, sin)[0][:T, None], None)
        # absorbed: the query in latent space, the cached rows as keys and their latent part as values
        from moestream.kernels import triton_paged_attention as paged

        s = self.shape
        query = torch.cat((torch.matmul(q_nope, self.k_up), q_rot), dim=-1)  # [N, R, R + Dr]
        attend = paged.paged_attention if T <= MAX_STEP_TOKENS else paged.paged_prefill
        latent = attend(query[:, :T].transpose(0, 1), kv.keys, kv.keys[..., :s.kv_lora_rank],
                        kv.block_table, positions, sequences, scale=self.scale, out_rows=x.shape[0])  # [R, N * R]
        out = torch.matmul(latent.view(-1, s.num_heads, s.kv_lora_rank).transpose(0, 1),
                           self.v_up.transpose(1, 2))  # [N, R rows, Dv]
        return self._out(out)

    def _row(self, x: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, kv: LayerCache) -> torch.Tensor:
        """One row x [1, H] on the CPU: its latent row written, then attention over its sequence's rows."""
        cos, sin = self.rope.cos_sin(pos, x.dtype)
        q_nope, q_rot = self._query(x, cos, sin)
        kv.write(pos, seq, self._latent(x, cos, sin)[0][:, None], None)
        p = int(pos)
        cached, _ = kv.gather(int(seq), 0, p + 1)  # [S, 1, R + Dr]
        return self._out(self.attend_absorbed(q_nope, q_rot, cached[:, 0], mask=None))

    def attend_expanded(self, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor, *,
                        mask: torch.Tensor | None, causal: bool) -> torch.Tensor:
        """The plain form: cached [S, R + Dr] -> per-head keys [N, S, Dn + Dr] and values [N, S, Dv]."""
        s, S = self.shape, cached.shape[0]
        kv = F.linear(cached[:, :s.kv_lora_rank], self.w.kv_b).view(S, s.num_heads, s.nope_dim + s.v_dim)
        kv = kv.transpose(0, 1)
        k_rot = cached[None, :, s.kv_lora_rank:].expand(s.num_heads, S, s.rope_dim)
        keys = torch.cat((kv[..., :s.nope_dim], k_rot), dim=-1)
        query = torch.cat((q_nope, q_rot), dim=-1)
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(query[None], keys[None], kv[None, ..., s.nope_dim:],
                                                 attn_mask=mask, is_causal=causal, scale=self.scale)
        return out[0]  # [N, T, Dv]

    def attend_absorbed(self, q_nope: torch.Tensor, q_rot: torch.Tensor, cached: torch.Tensor, *,
                        mask: torch.Tensor | None) -> torch.Tensor:
        """The absorbed form, the same result as attend_expanded: scores q_nope·(k_up c) equal
        (k_upᵀ q_nope)·c, so the query moves into latent space and the cached rows serve as keys
        (and their latent part as values) for every head; v_up then maps each head's output out."""
        s, S = self.shape, cached.shape[0]
        query = torch.cat((torch.matmul(q_nope, self.k_up), q_rot), dim=-1)  # [N, T, R + Dr]
        keys = cached[None].expand(s.num_heads, S, cached.shape[1])
        with sdpa_kernel(SDPA_BACKENDS):
            out = F.scaled_dot_product_attention(query[None], keys[None], keys[None, ..., :s.kv_lora_rank],
                                                 attn_mask=mask, scale=self.scale)
        return torch.matmul(out[0], self.v_up.transpose(1, 2))  # [N, T, R] -> [N, T, Dv]
