"""A multi-token-prediction (MTP) module: one extra decoder block that predicts the token after next.

At position p it takes the main model's last hidden state h_p (before the final norm) and the
embedding of the token at p + 1, mixes them as proj([norm_e(embed(t_{p+1})), norm_h(h_p)]), runs
its decoder block (attention over the positions it has seen, in its own KV cache, then the FFN,
routed experts included) and scores its normed output with the head: a guess for t_{p+2}. Chained,
its own output stands in for h at the next position (moestream.engine.mtp_drafter).

Legend: T positions, H hidden, V vocabulary."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moestream.kv.layout import LayerKV
from moestream.kv.pool import LayerCache

Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # (x, weight, eps) -> normed x


@dataclass
class MTPLayer:
    embed: torch.Tensor  # [V, H] (the main model's where the checkpoint shares it)
    embed_norm: torch.Tensor  # [H]
    hidden_norm: torch.Tensor  # [H]
    proj: torch.Tensor  # [H, 2H]: its input is [normed embedding, normed hidden]
    block: object  # a decoder layer: block(x, positions, sequences, kv)
    final_norm: torch.Tensor  # [H]
    head: torch.Tensor  # [V, H] (the main model's where the checkpoint shares it)
    kv: LayerKV  # the block's cache shape
    norm: Norm  # the family's RMSNorm (rms_norm, or offset_rms_norm for zero-centered weights)
    eps: float
    chain_normed: bool = False  # the state the next chained step takes: after the final norm, or before

    def __call__(self, hidden: torch.Tensor, ids: torch.Tensor, start: int, kv: LayerCache,
                 seq: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H] at positions start.., ids [T] the tokens one position later -> (the state a
        chained step takes [T, H], logits [T, V] in float32). Writes the block's K/V at start.. of
        sequence `seq` in `kv` (the caller reserved their blocks and records the positions)."""
        e = F.embedding(ids, self.embed)  # [T, H]
        h = hidden.to(e.dtype)
        x = F.linear(torch.cat([self.norm(e, self.embed_norm, self.eps), self.norm(h, self.hidden_norm, self.eps)], -1),
                     self.proj)
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        y = self.block(x, positions, torch.full_like(positions, seq), kv)  # [T, H]
        normed = self.norm(y, self.final_norm, self.eps)
        logits = F.linear(normed, self.head).to(torch.float32)
        return (normed if self.chain_normed else y), logits
