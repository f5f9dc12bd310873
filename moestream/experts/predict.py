"""Next-layer expert prediction: start reading the experts the next MoE layer will probably want.

The residual stream changes little from one layer to the next, so the next layer's router on this
layer's expert input picks many of the experts it will pick. Their early reads (the cache's
`prefetch`) start once this layer's experts are pinned: a wrong guess costs a read and a slot, never
an answer or a slot this layer needs. One token at a time only (a prefill chunk touches most experts)."""
from __future__ import annotations

import torch

from moestream.experts.guess_maps import GuessMaps

class NextLayerPrefetcher:
    """The CPU lookahead, called after each layer's fetch (`RoutedExperts.after_fetch`), its guesses
    scored and all copied by a Lookahead. blocks: the model's MoE blocks in order."""

    def __init__(self, blocks: list, provider, *, maps: GuessMaps | None = None):
        self.provider, self.maps = provider, maps
        self.next = {a.layer: b for a, b in zip(blocks, blocks[1:])}  # MoE layer -> the next MoE block
        # guesses that name too few of the experts a layer then routes to stop (CUDA's rule): each wrong
        # one is a whole record read that queues before the reads a layer waits for, and takes a slot
        self.lookahead = Lookahead(provider, depth=1)

    def __call__(self, layer: int, x: torch.Tensor, chosen: list[int] | None = None) -> None:
        if x.shape[0] != 1:
            return
        if chosen is not None:
            self.lookahead.score(layer, chosen)
        nxt = self.next.get(layer)
        if nxt is None:
            return
        # softmax keeps the order: the top-k of the logits is the router's
        logits = self.maps.logits(nxt, 1, x) if self.maps is not None else nxt.router_logits(x)
        ids = torch.topk(logits, nxt.top_k, dim=-1).indices.view(-1).tolist()
        self.lookahead.guess(nxt.layer, 1, ids)


class Lookahead:
    """Guesses of later MoE layers' experts (the CUDA decoder's, made in its graph, or the CPU
    prefetcher's), scored when those layers route: the share of its experts a guess named, an EMA
    per target layer and depth. Copies start only where it is at least `min_accuracy`: under routing
    the router does not predict (a benchmark's uniform draw) guesses cost no bandwidth."""

    def __init__(self, provider, *, depth: int, min_accuracy: float = 0.3, decay: float = 0.9):
        self.provider, self.depth = provider, depth
        self.min_accuracy, self.decay = min_accuracy, decay
        self.pending: dict[int, list[tuple[int, set[int]]]] = {}  # target layer -> [(depth, guessed ids)]
        self.ema: dict[tuple[int, int], float] = {}
        self.hits: dict[tuple[int, int], int] = {}
        self.guessed: dict[tuple[int, int], int] = {}

    def score(self, layer: int, actual: list[int]) -> None:
        """`layer` routed to `actual`: score the guesses made for it."""
        chosen = set(actual)
        for depth, guess in self.pending.pop(layer, []):
            key = (layer, depth)
            right = len(guess & chosen)
            self.hits[key] = self.hits.get(key, 0) + right
            self.guessed[key] = self.guessed.get(key, 0) + len(guess)
            acc = right / max(1, len(guess))
            self.ema[key] = acc if key not in self.ema else self.decay * self.ema[key] + (1 - self.decay) * acc
            # no score yet counts as good enough: the first guesses are tried

    def guess(self, layer: int, depth: int, ids: list[int]) -> int:
        """A guess of `layer`'s experts made `depth` MoE layers ahead; returns the copies started."""
        self.pending.setdefault(layer, []).append((depth, set(ids)))
        if self.ema.get((layer, depth), 1.0) < self.min_accuracy:
            return 0
        return self.provider.prefetch(layer, sorted(set(ids)))

    def stats(self) -> dict:
        """Accuracy per target layer and depth, overall per depth."""
        per_layer = {f"{layer}@{depth}": round(self.hits[(layer, depth)] / self.guessed[(layer, depth)], 4)
                     for layer, depth in sorted(self.guessed) if self.guessed[(layer, depth)]}
        overall = {}
        for d in range(1, self.depth + 1):
            g = sum(v for (_, dd), v in self.guessed.items() if dd == d)
            overall[f"depth{d}"] = round(sum(v for (_, dd), v in self.hits.items() if dd == d) / g, 4) if g else None
        return {"depth": self.depth, "min_accuracy": self.min_accuracy, "accuracy": overall,
                "accuracy_per_layer": per_layer}
