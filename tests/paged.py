"""Running one attention module over the paged KV pool in tests: chunks of rows of one sequence,
each chunk's blocks reserved first, as the engine does."""
from __future__ import annotations

import torch

from moestream.kv.pool import KVPool


def pool_for(layout, *, context: int = 64, sequences: int = 1, block_size: int = 16, dtype=torch.float32,
             device=torch.device("cpu")) -> KVPool:
    return KVPool(layout, max_sequences=sequences, max_context=context, dtype=dtype, device=device,
                  block_size=block_size, prefill_chunk=context)


def run_chunks(attn, x: torch.Tensor, pool: KVPool, chunks: list[int] | None = None, *, seq: int = 0) -> torch.Tensor:
    """attn.forward over x's rows in `chunks` at the next positions of sequence `seq` -> [sum(chunks), H]."""
    cache, outs = pool.sequences[seq], []
    start = cache.length
    for n in chunks or [x.shape[0]]:
        cache.reserve(start, start + n)
        pool.sync()
        pos = torch.arange(start, start + n, device=x.device)
        outs.append(attn.forward(x[start:start + n], pos, torch.full_like(pos, seq), pool.layer(0)))
        cache.append([1000 * (seq + 1) + p for p in range(start, start + n)])  # ids no other sequence has
        start += n
    return torch.cat(outs)

