"""Plain torch references of moestream.kernels.triton_paged_attention (store_kv, paged_attention,
paged_prefill: the last two compute the same thing) and the paged inputs the tests draw.

Each row gathers its visible positions through the block table and computes
softmax(q k^T * scale (soft-capped), with the sink logit in the denominator) v in float32."""
from __future__ import annotations

import torch


def reference_store_kv(k, v, positions, seq_of_row, block_table, k_cache, v_cache) -> None:
    BS = k_cache.shape[1]
    for t in range(k.shape[0]):
        p, s = int(positions[t]), int(seq_of_row[t])
        block = int(block_table[s, p // BS])
        k_cache[block, p % BS] = k[t]
        v_cache[block, p % BS] = v[t]


def reference_paged_attention(q, k_cache, v_cache, block_table, positions, seq_of_row, *, scale, window=None,
                              sinks=None, softcap=None, out_rows=None) -> torch.Tensor:
    """[out_rows or T, Nq*Dv] in q's dtype, rows past T zero."""
    T, Nq, _ = q.shape
    _, BS, Nkv, _ = k_cache.shape
    Dv = v_cache.shape[3]
    G = Nq // Nkv
    out = torch.zeros(T if out_rows is None else out_rows, Nq, Dv, dtype=torch.float32, device=q.device)
    for t in range(T):
        p, s = int(positions[t]), int(seq_of_row[t])
        lo = 0 if window is None else max(0, p - window + 1)
        idx = torch.arange(lo, p + 1, device=q.device)
        blocks = block_table[s].long()[idx // BS]
        k = k_cache[blocks, idx % BS].float().repeat_interleave(G, dim=1)  # [L, Nq, D]
        v = v_cache[blocks, idx % BS].float().repeat_interleave(G, dim=1)  # [L, Nq, Dv]
        scores = torch.einsum("hd,lhd->hl", q[t].float(), k) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        weights = torch.softmax(scores, dim=1)[:, :idx.numel()]
        out[t] = torch.einsum("hl,lhd->hd", weights, v)
    return out.reshape(out.shape[0], Nq * Dv).to(q.dtype)


def paged_cache(g, *, seqs, BS, Nkv, D, Dv, dtype, spare=3):
    """A pool holding `seqs` (lengths, one per sequence) in shuffled physical blocks, a few spare
    blocks beside them, random contents: (k_cache, v_cache, block_table int32 [S, MB])."""
    MB = max(-(-n // BS) for n in seqs)
    NB = sum(-(-n // BS) for n in seqs) + spare
    order = torch.randperm(NB, generator=g).to(torch.int32)
    table = torch.full((len(seqs), MB), -1, dtype=torch.int32)
    used = 0
    for s, n in enumerate(seqs):
        nb = -(-n // BS)
        table[s, :nb] = order[used:used + nb]
        used += nb
    k_cache = torch.randn(NB, BS, Nkv, D, generator=g).to(dtype)
    v_cache = torch.randn(NB, BS, Nkv, Dv, generator=g).to(dtype)
    return k_cache, v_cache, table
