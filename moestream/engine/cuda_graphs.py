"""CUDA graphs for one-token decode steps.

On the GPU, a decode step is bound by the host: each layer issues dozens of small kernels. The
attention half of every layer (norm, q/k/v, q/k norms, rotary, KV write, attention, output
projection, residual, the FFN's norm) never depends on which experts are cached, so it is captured
once per (layer, key-length bucket) and replayed. The position lives in a device tensor, and
attention runs over a power-of-two bucket of the KV cache with a mask, so one graph serves many
steps. The routed experts stay outside the graphs: which ones run, and where their slots are, is
decided on the host every step."""
from __future__ import annotations

import torch

from moestream.engine.kv_cache import KVCache

MIN_BUCKET = 256


class DecodeGraphs:
    def __init__(self, model, cache: KVCache):
        self.model, self.cache = model, cache
        hidden = model.embed.shape[1]
        self.x = torch.zeros((1, hidden), dtype=model.dtype, device=model.device)  # a layer's input
        self.pos = torch.zeros(1, dtype=torch.long, device=model.device)
        self.bucket = MIN_BUCKET
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, tuple]] = {}
        self.pool = torch.cuda.graph_pool_handle()

    def set_position(self, start: int) -> None:
        self.pos.fill_(start)
        bucket = MIN_BUCKET
        while bucket < start + 1:
            bucket *= 2
        self.bucket = min(bucket, self.cache.max_tokens)

    def _run(self, layer: int, bucket: int):
        m = self.model
        cos, sin = m.rope.cos_sin(self.pos, self.x.dtype)
        return m.layers[layer].attention_half(self.x, cos, sin, self.cache, layer, 0, pos=self.pos, bucket=bucket)

    def attention_half(self, layer: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.x.copy_(x)
        key = (layer, self.bucket)
        if key not in self.graphs:
            side = torch.cuda.Stream(self.x.device)
            side.wait_stream(torch.cuda.current_stream(self.x.device))
            with torch.cuda.stream(side):  # warm up (also writes this step's K/V, as the replay will again)
                self._run(layer, self.bucket)
            torch.cuda.current_stream(self.x.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                out = self._run(layer, self.bucket)
            self.graphs[key] = (graph, out)
        graph, out = self.graphs[key]
        graph.replay()
        return out
