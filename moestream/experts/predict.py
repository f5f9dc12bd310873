"""Next-layer expert prediction: start reading the experts the next MoE layer will probably want
while the current layer computes.

The residual stream changes little from one layer to the next, so the next layer's router applied
to this layer's expert input picks many of the experts that router will pick a moment later. Their
reads start early through the cache's `prefetch`, issued once this layer's own experts are pinned,
so a wrong guess costs a read and a slot, never an answer and never a slot this layer needs. One
token at a time only: a prefill chunk touches most experts anyway. The cache counts the guesses
issued and used (`prefetch_issued`, `prefetch_used` in its stats)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.layers.experts import ExpertProvider, RoutedExperts
from moestream.layers.moe import MoEBlock

MODES = ("next-layer", "none")


class NextLayerPrefetcher:
    def __init__(self, blocks: list[MoEBlock], provider):
        self.provider = provider
        self.next = {a.layer: b for a, b in zip(blocks, blocks[1:])}  # MoE layer -> the next MoE block

    def __call__(self, layer: int, x: torch.Tensor) -> None:
        nxt = self.next.get(layer)
        if nxt is None or x.shape[0] != 1:
            return
        logits = F.linear(x, nxt.router)  # softmax keeps the order: the top-k of the logits is the router's
        ids = torch.topk(logits, nxt.top_k, dim=-1).indices.view(-1).tolist()
        self.provider.prefetch(nxt.layer, sorted(ids))


def attach(model, experts: RoutedExperts, provider: ExpertProvider, mode: str) -> NextLayerPrefetcher | None:
    """Hook a predictor into the model's routed experts (mode "next-layer"), or none ("none")."""
    if mode not in MODES:
        raise ValueError(f"prefetch mode {mode!r} (choose from {', '.join(MODES)})")
    if mode == "none":
        return None
    blocks = [layer.ffn for layer in model.layers if isinstance(layer.ffn, MoEBlock)]
    predictor = NextLayerPrefetcher(blocks, provider)
    experts.after_fetch = predictor
    return predictor
