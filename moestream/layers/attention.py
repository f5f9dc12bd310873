"""GQA self-attention over the paged KV pool, one class for every family that has it.

Options cover what the families differ in: a sliding window, per-head sink logits, a fixed score
scale and a soft cap on the scores, q/k norms per head or over the whole projection (with the
family's RMSNorm), clipping of q/k/v, keys reused as values (k_eq_v) with a scale-free norm on the
values, the family's rotary table (partial, proportional, YaRN: moestream.layers.rope), an output
gate (q_proj gives each head's query and gate side by side) and biases.

`forward(x, positions, sequences, kv)` is the one entry for prefill chunks, decode steps, a step's
rows at once, speculative verification and batches: row t is the token at positions[t] of sequence
sequences[t]; every row's K/V are written into the pool's blocks before any row attends, so a later
row of a sequence sees the earlier ones. A row's bits never depend on the rows beside it: on the CPU
its products are one-row products batched (rows_linear, where exact; else one call per row) and it
attends alone; on CUDA the caller's products run over a fixed row tile and the paged Triton kernels
(moestream.kernels.triton_paged_attention) store and attend.

Legend: R rows of x (R >= T), T tokens, H hidden, Nq/Nkv heads, D head size (Dv values), S positions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moestream.kernels.reference import rows_exact, rows_linear, rowwise
from moestream.kv.pool import MAX_STEP_TOKENS, LayerCache
from moestream.layers.norm import rms_norm
from moestream.layers.norm_f32 import rms_norm_f32
from moestream.layers.packed_matrix import PackedMatrix
from moestream.layers.rope import Rope, apply_rope

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> normed x


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm whose weight is stored centered on 0: `scale` is 1 + w in float32, applied in float32
    before rounding back to x's dtype (the reference's order)."""
    if x.is_cuda:
        from moestream.kernels.triton_norm import rms_norm_rows
        return rms_norm_rows(x, scale, eps, "f32")
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * scale).to(x.dtype)


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear with each row's bits those of F.linear on that row alone (CPU): a packed matrix's
    products as they are (each row on its own whatever the rows beside it); else one batched call of
    one-row products where `rows_exact` says they agree, else one call per row."""
    if isinstance(weight, PackedMatrix) or x.shape[0] == 1:
        y = F.linear(x, weight)
    elif not rows_exact(x.dtype, weight.shape[1], weight.shape[0]):
        y = torch.cat([F.linear(x[t:t + 1], weight) for t in range(x.shape[0])])
    else:
        y = rows_linear(x, weight).view(x.shape[0], -1)
    return y if bias is None else y + bias


@dataclass
class AttentionWeights:
    q: torch.Tensor  # [Nq * D, H] ([Nq * 2D, H] with a gate: per head, D query rows then D gate rows)
    k: torch.Tensor  # [Nkv * D, H]
    v: torch.Tensor | None  # [Nkv * Dv, H]; None: values are the keys' projection (k_eq_v)
    o: torch.Tensor  # [H, Nq * Dv]
    q_bias: torch.Tensor | None = None
    k_bias: torch.Tensor | None = None
    v_bias: torch.Tensor | None = None
    o_bias: torch.Tensor | None = None
    q_norm: torch.Tensor | None = None  # [D] per head, or [Nq * D] over the projection
    k_norm: torch.Tensor | None = None
    sinks: torch.Tensor | None = None  # [Nq]: a learned logit per head that takes part in the softmax, no value
    qkv: torch.Tensor | None = None  # [q; k; v] rows in one tensor (q, k, v are views of it): one product
    qkv_bias: torch.Tensor | None = None

    def fuse_qkv(self) -> None:
        """Store q, k (and v) as row blocks of one tensor, so that the projections are one product."""
        parts = [self.q, self.k] + ([] if self.v is None else [self.v])
        self.qkv = torch.cat(parts)
        nq, nk = self.q.shape[0], self.k.shape[0]
        self.q, self.k = self.qkv[:nq], self.qkv[nq:nq + nk]
        if self.v is not None:
            self.v = self.qkv[nq + nk:]
        if self.q_bias is not None:
            self.qkv_bias = torch.cat([self.q_bias, self.k_bias] + ([] if self.v is None else [self.v_bias]))


# the per-head norms the CUDA kernel computes with the rotary (moestream.kernels.triton_norm's kinds)
_CUDA_NORM_KINDS = {rms_norm: "round", rms_norm_f32: "f32", offset_rms_norm: "f32"}


class Attention:
    def __init__(self, weights: AttentionWeights, rope: Rope, *, num_heads: int, num_kv_heads: int, head_dim: int,
                 eps: float, qk_norm: str | None = None, norm: Norm = rms_norm, clip_qkv: float | None = None,
                 window: int | None = None, scale: float | None = None, softcap: float | None = None,
                 v_norm: bool = False, gate: bool = False):
        """qk_norm: "head" (per head over D), "full" (over the whole projection) or None; norm: the
        family's RMSNorm for them. scale: the score scale (default D^-1/2). softcap: cap * tanh(s / cap)
        on the scores. v_norm: a scale-free RMSNorm on the values. gate: an output gate in q_proj."""
        self.w, self.rope = weights, rope
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.eps, self.qk_norm, self.norm, self.clip_qkv = eps, qk_norm, norm, clip_qkv
        self.window, self.softcap, self.v_norm, self.gate = window, softcap, v_norm, gate
        self.scale = head_dim ** -0.5 if scale is None else scale
        self._qk_weight = None  # _qk_norm_weight's

    def _project(self, x: torch.Tensor, linear, head_norm: bool = True) -> tuple[torch.Tensor, ...]:
        """x [R, H] -> q [R, Nq, D], k [R, Nkv, D], v [R, Nkv, Dv], gate [R, Nq * D] or None.
        head_norm=False: q and k not yet normed per head (the CUDA path norms them with the rotary)."""
        w, R, D = self.w, x.shape[0], self.head_dim
        qkv = linear(x, w.qkv, w.qkv_bias) if w.qkv is not None else \
            torch.cat([linear(x, m, b) for m, b in ((w.q, w.q_bias), (w.k, w.k_bias), (w.v, w.v_bias))
                       if m is not None], dim=-1)
        nq, nkv = w.q.shape[0], w.k.shape[0]
        q, k = qkv[:, :nq], qkv[:, nq:nq + nkv]
        v = k if w.v is None else qkv[:, nq + nkv:]
        if self.qk_norm == "full":
            q, k = self.norm(q, w.q_norm, self.eps), self.norm(k, w.k_norm, self.eps)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        gate = None
        if self.gate:
            qg = q.reshape(R, self.num_heads, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(R, self.num_heads * D)
        q, k = q.reshape(R, self.num_heads, D), k.reshape(R, self.num_kv_heads, D)
        v = v.reshape(R, self.num_kv_heads, -1)
        if self.qk_norm == "head" and head_norm:
            q, k = self.norm(q, w.q_norm, self.eps), self.norm(k, w.k_norm, self.eps)
        if self.v_norm:
            v = rms_norm_f32(v, None, self.eps)
        return q, k, v, gate

    def _qk_norm_weight(self) -> torch.Tensor | None:
        """The per-head norm weights of q's heads, then k's [Nq + Nkv, D] (made once)."""
        if self._qk_weight is None and self.w.q_norm is not None:
            self._qk_weight = torch.cat([self.w.q_norm.expand(self.num_heads, -1),
                                         self.w.k_norm.expand(self.num_kv_heads, -1)])
        return self._qk_weight

    def _cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, R] of positions; on the CPU each row as its position alone gives it (a vectorized
        cos may round a vector's tail otherwise), computed once for all layers of a step."""
        if positions.is_cuda or positions.shape[0] > MAX_STEP_TOKENS:
            return self.rope.cos_sin(positions, dtype)  # (a prefill chunk's rows need no step's bits)
        return self.rope.rows_cos_sin(positions, dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                linear=None) -> torch.Tensor:
        """x [R, H] (normed), positions and sequences [T] (T <= R, on x's device) -> [R, H] (rows past T:
        what zeros give). linear: the products' kernel over all R rows (a decode step passes the row
        tile's; default: F.linear on CUDA and for a prefill chunk of more rows than a step has,
        else row_linear, the rows of a step on the CPU)."""
        T = positions.shape[0]
        linear = linear or (F.linear if x.is_cuda or T > MAX_STEP_TOKENS else row_linear)
        if x.is_cuda:
            # the per-head q/k norm and the rotary in one kernel each (moestream.kernels.triton_norm)
            kind = _CUDA_NORM_KINDS.get(self.norm) if self.qk_norm == "head" else None
            q, k, v, gate = self._project(x, linear, head_norm=kind is None)
            q, k = self._norm_rope(q[:T], k[:T], positions, kind)
            out = self._attend_cuda(q, k, v[:T], positions, sequences, kv, x.shape[0])
        else:
            # q's and k's heads side by side [T, Nq + Nkv, D]: normed and rotated as one tensor
            q, k, v, gate = self._project(x, linear, head_norm=False)
            qk = torch.cat([q[:T], k[:T]], dim=1)
            if self.qk_norm == "head":
                qk = self.norm(qk, self._qk_norm_weight(), self.eps)
            qk = apply_rope(qk.transpose(0, 1), *self._cos_sin(positions, x.dtype))  # [Nq + Nkv, T, D]
            q, k = qk[:self.num_heads], qk[self.num_heads:].transpose(0, 1)  # [Nq, T, D], [T, Nkv, D]
            kv.write(positions, sequences, k, v[:T])
            out = self._attend_cpu(q, positions, sequences, kv)
            if x.shape[0] > T:
                out = torch.cat([out, out.new_zeros((x.shape[0] - T, out.shape[1]))])
        if gate is not None:
            out = out * rowwise(torch.sigmoid, gate[:out.shape[0]])
        return linear(out, self.w.o, self.w.o_bias)

    def _attend_cpu(self, q: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor,
                    kv: LayerCache) -> torch.Tensor:
        """q [Nq, T, D] -> [T, Nq * Dv]: a step's rows (at most MAX_STEP_TOKENS) each alone over its
        sequence's visible positions; a prefill chunk's (more rows, one sequence) at once, masked."""
        T = q.shape[1]
        if T > MAX_STEP_TOKENS:
            seq, first, last = int(sequences[0]), int(positions[0]), int(positions[-1])
            lo = kv.first_visible(first)
            keys, values = kv.gather(seq, lo, last + 1)  # [S, Nkv, D]
            seen = positions[:, None] >= torch.arange(lo, last + 1)[None, :]
            if self.window is not None:
                seen &= torch.arange(lo, last + 1)[None, :] > positions[:, None] - self.window
            return self.attend(q, keys.transpose(0, 1), values.transpose(0, 1), seen)
        out = []
        for t, (pos, seq) in enumerate(zip(positions.tolist(), sequences.tolist())):
            keys, values = kv.gather(seq, kv.first_visible(pos), pos + 1)  # [S, Nkv, D]
            out.append(self.attend(q[:, t:t + 1], keys.transpose(0, 1), values.transpose(0, 1), None))
        return out[0] if len(out) == 1 else torch.cat(out)

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               mask: torch.Tensor | None) -> torch.Tensor:
        """q [Nq, T, D], keys [Nkv, S, D], values [Nkv, S, Dv], mask [T, S] bool or None (all visible)
        -> [T, Nq * Dv]. A head's sink logit joins the softmax and is then dropped."""
        T, S, Nkv = q.shape[1], keys.shape[1], keys.shape[0]
        # a KV head's queries as one matrix [Nkv, groups * T, D]: no copies of its keys and values
        scores = torch.matmul(q.reshape(Nkv, -1, q.shape[2]), keys.transpose(1, 2)).view(q.shape[0], T, S) * self.scale
        if self.softcap is not None:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        if self.w.sinks is not None:
            sinks = self.w.sinks.to(scores.dtype)[:, None, None].expand(-1, T, 1)
            scores = torch.cat([scores, sinks], dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(values.dtype)[..., :S]
        out = torch.matmul(probs.reshape(Nkv, -1, S), values).view(-1, T, values.shape[2])  # [Nq, T, Dv]
        return out.transpose(0, 1).reshape(T, -1)

    def _norm_rope(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                   kind: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Nq, D], k [T, Nkv, D] -> the same, each head normed (kind: triton_norm's, None: no
        norm), then rotated: one kernel for both."""
        from moestream.kernels.triton_norm import norm_rope

        return norm_rope(q, positions, self.rope.inv_freq, self.rope.scale, weight=self.w.q_norm, eps=self.eps,
                         kind=kind, other=k, other_weight=self.w.k_norm)

    def _attend_cuda(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                     sequences: torch.Tensor, kv: LayerCache, rows: int) -> torch.Tensor:
        """Store the rows' K/V in their blocks, then attend with no host read (capturable): the paged
        Triton kernels, decode's split form for a step's rows, the prefill form for a chunk's.
        q [T, Nq, D] -> [rows, Nq * Dv] (rows past T zero)."""
        from moestream.kernels import triton_paged_attention as paged

        paged.store_kv(k, v, positions, sequences, kv.block_table, kv.keys, kv.values)
        attend = paged.paged_attention if q.shape[0] <= MAX_STEP_TOKENS else paged.paged_prefill
        return attend(q, kv.keys, kv.values, kv.block_table, positions, sequences, scale=self.scale,
                      window=self.window, sinks=None if self.w.sinks is None else self.w.sinks.float(),
                      softcap=self.softcap, out_rows=rows)
