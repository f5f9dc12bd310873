"""Next-layer expert prediction: start reading the experts the next MoE layer will probably want.

The residual stream changes little from one layer to the next, so the next layer's router on this
layer's expert input picks many of the experts it will pick. The decoder makes the guesses
(moestream.engine.decoder: on CUDA inside its graphs); their early reads (the cache's `prefetch`)
start once this layer's experts are pinned: a wrong guess costs a read and a slot, never an answer or
a slot this layer needs. One token at a time only (a prefill chunk touches most experts)."""
from __future__ import annotations


class Lookahead:
    """Guesses of later MoE layers' experts (the decoder's), scored when those layers route: the share
    of its experts a guess named, an EMA per target layer and depth. Copies start only where it is at
    least `min_accuracy`: under routing the router does not predict (a benchmark's uniform draw)
    guesses cost no bandwidth (each wrong one is a whole record read queued before the reads a layer
    waits for, and a slot)."""

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
