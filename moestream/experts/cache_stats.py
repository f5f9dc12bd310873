"""The slot cache's figures: hits and misses (in total and per layer), bytes read per tier, time
waiting on reads, early reads issued and used, evictions.

Kept apart from the slot cache (moestream.experts.cache) because the figures come from several
places that are not the cache's lookups: the device-driven path's and the resident tables'
counts, and misses another compute unit served. Plain counters, no locking: the cache holds its
lock where reader threads add to them."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    bytes_read_disk: int = 0
    bytes_read_host: int = 0
    read_wait_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    evictions: int = 0
    layer_hits: dict = field(default_factory=dict)
    layer_misses: dict = field(default_factory=dict)

    def count(self, layer: int, *, hit: bool, n: int = 1) -> None:
        """Book n hits (or misses) of `layer`."""
        table = self.layer_hits if hit else self.layer_misses
        table[layer] = table.get(layer, 0) + n
        if hit:
            self.hits += n
        else:
            self.misses += n

    def add_device_counts(self, counts: dict[int, tuple[int, int]], record_bytes: dict[int, int]) -> None:
        """Book the device-driven path's {layer: (hits, misses)}; each miss copied one record from the host tier."""
        for layer, (hits, misses) in counts.items():
            self.count(layer, hit=True, n=hits)
            self.count(layer, hit=False, n=misses)
            self.bytes_read_host += misses * record_bytes[layer]

    def hit_rate_per_layer(self, layers: list[int]) -> dict[str, float]:
        """{layer: hit rate} of the layers that were looked up at all."""
        rates = {}
        for layer in layers:
            hits, misses = self.layer_hits.get(layer, 0), self.layer_misses.get(layer, 0)
            if hits + misses:
                rates[str(layer)] = round(hits / (hits + misses), 4)
        return rates
