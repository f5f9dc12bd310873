"""Gated DeltaNet: the linear-attention layer of Qwen3-Next and Qwen3.5.

Per token t (per value head; q, k of the head's key group, L2-normed, q scaled by Dk^-1/2):

    S = exp(g_t) * S                       decay, g_t = -exp(A_log) * softplus(a_t + dt_bias)
    S = S + k_t (beta_t (v_t - S^T k_t))^T  the delta rule: write the part of v_t S does not yet predict
    o_t = S^T q_t                           S [Dk, Dv] float32, beta_t = sigmoid(b_t)

q, k, v come from a depthwise causal convolution (width K, SiLU) over the projected inputs, so the
layer's cache is S and the convolution's last K-1 inputs (moestream.kv.recurrent). The
output is RMS-normed per head, gated by SiLU(z), and projected back.

Prefill runs the chunked form (a chunk's tokens in a few matmuls, the state carried between
chunks), a one-token step the recurrent form above; both are in torch (CPU and CUDA)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.kv.pool import LayerCache
from moestream.kv.recurrent import RECENT_STATES, RecurrentState

CHUNK = 64  # tokens per chunk of the chunked form


@dataclass
class DeltaNetWeights:
    qkv: torch.Tensor  # [2 Hk Dk + Hv Dv, H]: q, k, v rows, head by head within each
    z: torch.Tensor  # [Hv Dv, H]: the output gate
    b: torch.Tensor  # [Hv, H]: beta (write strength)
    a: torch.Tensor  # [Hv, H]: the decay's input
    conv: torch.Tensor  # [C, K] depthwise convolution, C = 2 Hk Dk + Hv Dv
    neg_a: torch.Tensor  # [Hv] float32: -exp(A_log)
    dt_bias: torch.Tensor  # [Hv] float32
    norm: torch.Tensor  # [Dv]: the per-head RMSNorm before the gate
    out: torch.Tensor  # [H, Hv Dv]


def l2_normalize(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of x [.., Dv] (statistics in float32, scale in x's dtype), times SiLU(gate) in float32."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * x32.to(x.dtype) * F.silu(gate.to(torch.float32))).to(x.dtype)


def delta_rule_step(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token: S [Hv, Dk, Dv], q, k [Hv, Dk], v [Hv, Dv], g, beta [Hv] (all float32) -> (o [Hv, Dv], S)."""
    S = S * g.exp()[:, None, None]
    predicted = (S * k[:, :, None]).sum(dim=-2)  # [Hv, Dv]
    S = S + k[:, :, None] * ((v - predicted) * beta[:, None])[:, None, :]
    return (S * q[:, :, None]).sum(dim=-2), S


def delta_rule_chunked(S: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The same recurrence over one chunk at once: q, k [Hv, T, Dk], v [Hv, T, Dv], g, beta [Hv, T]
    (float32, T <= CHUNK) -> (o [Hv, T, Dv], S after the chunk).

    Within the chunk, with G_t = g_1 + .. + g_t, the delta rule's writes u_t solve a unit lower
    triangular system (the decayed k_i . k_j of earlier tokens subtract what they already wrote);
    the output adds the decayed start state's read and the chunk's own causal attention."""
    T = q.shape[1]
    G = g.cumsum(dim=-1)  # [Hv, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    decay = (G[:, :, None] - G[:, None, :]).masked_fill(~causal, float("-inf")).exp()  # [Hv, T, T]: exp(G_i - G_j), j <= i
    kb, vb = k * beta[..., None], v * beta[..., None]
    system = (kb @ k.transpose(-1, -2)) * decay  # [Hv, T, T], unit diagonal once the strict part is kept
    system = system.tril(-1) + torch.eye(T, dtype=q.dtype, device=q.device)
    # u = beta (v - decayed reads of S and of the earlier writes): solve system @ u = rhs
    rhs = vb - (kb * G.exp()[..., None]) @ S
    u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)  # [Hv, T, Dv]
    attn = (q @ k.transpose(-1, -2)) * decay  # [Hv, T, T]
    o = (q * G.exp()[..., None]) @ S + attn @ u
    last = G[:, -1:]  # [Hv, 1]
    S = S * last.exp()[..., None] + (k * (last - G).exp()[..., None]).transpose(-1, -2) @ u
    return o, S


class GatedDeltaNet:
    def __init__(self, w: DeltaNetWeights, *, num_k_heads: int, num_v_heads: int, k_dim: int, v_dim: int, eps: float):
        self.w, self.eps = w, eps
        self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim = num_k_heads, num_v_heads, k_dim, v_dim
        self.width = w.conv.shape[1]

    def _inputs(self, x: torch.Tensor, conv: torch.Tensor):
        """x [T, H] and the convolution's last K-1 inputs [K-1, C] -> q, k [Hv, T, Dk], v [Hv, T, Dv],
        g, beta [Hv, T] (float32), z [T, Hv, Dv], and the convolution's inputs [K-1+T, C]."""
        w, T = self.w, x.shape[0]
        Hk, Hv, Dk, Dv = self.num_k_heads, self.num_v_heads, self.k_dim, self.v_dim
        window = torch.cat([conv.to(x.dtype), F.linear(x, w.qkv)])  # [K-1+T, C]
        mixed = F.silu(F.conv1d(window.t()[None], w.conv[:, None, :], groups=w.conv.shape[0])[0].t())  # [T, C]
        q, k, v = mixed.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
        groups = Hv // Hk
        q = q.reshape(T, Hk, Dk).repeat_interleave(groups, dim=1).transpose(0, 1).to(torch.float32)
        k = k.reshape(T, Hk, Dk).repeat_interleave(groups, dim=1).transpose(0, 1).to(torch.float32)
        v = v.reshape(T, Hv, Dv).transpose(0, 1).to(torch.float32)
        q, k = l2_normalize(q) * Dk ** -0.5, l2_normalize(k)
        beta = torch.sigmoid(F.linear(x, w.b)).t().to(torch.float32)  # [Hv, T]
        g = (w.neg_a * F.softplus(F.linear(x, w.a).to(torch.float32) + w.dt_bias)).t()  # [Hv, T]
        z = F.linear(x, w.z).view(T, Hv, Dv)
        return q, k, v, g, beta, z, window

    def _output(self, o: torch.Tensor, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """o [Hv, T, Dv] float32 -> [T, H]."""
        o = o.transpose(0, 1).to(dtype)  # [T, Hv, Dv]
        y = gated_rms_norm(o, z, self.w.norm, self.eps)
        return F.linear(y.reshape(o.shape[0], -1), self.w.out)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                linear=None) -> torch.Tensor:
        """x [R, H] (normed), positions and sequences [T] -> [R, H] (rows past T: zeros). More rows
        than a step has are a prefill chunk of one sequence (the chunked form); a step's rows run one
        by one (each reads the state its sequence's previous row wrote), so a row's bits never
        depend on the rows beside it."""
        T = positions.shape[0]
        if T > RECENT_STATES - 1:
            return self._run(x, int(sequences[0]), int(positions[0]), kv.states)
        rows = [self._step(x[t:t + 1], positions[t:t + 1], sequences[t:t + 1], kv.states) for t in range(T)]
        if x.shape[0] > T:
            rows.append(x.new_zeros((x.shape[0] - T, x.shape[1])))
        return torch.cat(rows)

    def _run(self, x: torch.Tensor, seq: int, start: int, rec: RecurrentState) -> torch.Tensor:
        """Positions start.. of sequence `seq`: chunks of CHUNK tokens aligned to absolute positions (so
        snapshot lengths fall on chunk ends), the last tokens one by one (their states go to the ring)."""
        T, end = x.shape[0], start + x.shape[0]
        S, conv = rec.read(seq, start)
        q, k, v, g, beta, z, window = self._inputs(x, conv)
        outs, t = [], 0
        one_by_one = max(0, end - (RECENT_STATES - 1))  # from this position on, every length is kept
        while t < T:
            pos = start + t
            if pos >= one_by_one:
                o, S = delta_rule_step(S, q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t])
                outs.append(o[:, None])
                t += 1
            else:
                n = min(CHUNK - pos % CHUNK, one_by_one - pos, rec.every - pos % rec.every)
                o, S = delta_rule_chunked(S, q[:, t:t + n], k[:, t:t + n], v[:, t:t + n], g[:, t:t + n],
                                          beta[:, t:t + n])
                outs.append(o)
                t += n
            if rec.wants(start + t, end):
                rec.write(seq, start + t, end, S, window[t:t + self.width - 1])
        return self._output(torch.cat(outs, dim=1), z, x.dtype)

    def _step(self, x: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor, rec: RecurrentState) -> torch.Tensor:
        """One token x [1, H] at the device position pos [1] of sequence seq [1]: no host read (CUDA graphs)."""
        S, conv = rec.read_at(seq, pos)
        q, k, v, g, beta, z, window = self._inputs(x, conv)
        o, S = delta_rule_step(S, q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0])
        rec.write_at(seq, pos + 1, S, window[1:])
        return self._output(o[:, None], z, x.dtype)
