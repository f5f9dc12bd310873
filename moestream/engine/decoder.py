"""One-token decode steps on CUDA, built from static buffers so that they replay as CUDA graphs.

On the GPU a decode step is bound by the host: a layer is ~20 small kernels, each of which costs
more to launch from Python than to run. So a step is cut into segments that never read a device
value on the host, each captured once and replayed:

  - per layer, "attention": norm, q/k/v, rotary, KV write, attention, residual, the FFN's norm and
    the router's top-k (the ids land in a static buffer), in fused kernels
    (moestream.kernels.triton_decode) that read the position from the device, so one graph
    serves every position;
  - per MoE layer, "experts": the routed experts from a device slot table, plus the residual.

When every expert of every layer is resident (the cache holds them all), the slot tables never
change, and the whole step -- embedding, all layers, head -- is one graph: no host work and no
synchronization until the logits. Otherwise, between a layer's two segments the host reads the
chosen ids (the one sync per layer), asks the cache for their slots (loading misses), and writes
the layer's slot table. Both ways run the same kernels on the same bytes, so the logits are the
same bits for any cache size; with graphs off the same segments run eagerly."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.engine.kv_cache import KVCache
from moestream.kernels import dispatch
from moestream.kernels import triton_decode as td
from moestream.layers.moe import MoEBlock


@dataclass
class _Routed:
    """A MoE layer's buffers: its slot table, and what its attention segment hands its experts."""

    table: torch.Tensor  # [E] int32 slot of each expert (device)
    ids_host: torch.Tensor  # [A] int64, pinned
    table_host: torch.Tensor  # [E] int32, pinned
    weights: torch.Tensor | None = None  # [1, A] routing weights  } outputs of the attention segment
    ids: torch.Tensor | None = None  # [1, A] int64 expert ids     } (static ones when it is a graph)
    h: torch.Tensor | None = None  # [1, H] residual stream after attention
    hn: torch.Tensor | None = None  # [1, H] its normed copy, the experts' input


def supported(model, provider) -> str | None:
    """Why this model cannot take the CUDA decoder (None if it can)."""
    if model.device.type != "cuda":
        return "not on CUDA"
    if dispatch.triton_module() is None:
        return "Triton is not installed"
    probe = torch.zeros((1, model.embed.shape[1]), dtype=model.dtype, device=model.device)
    for layer in model.layers:
        if isinstance(layer.ffn, MoEBlock) and dispatch.triton_layout(probe, provider, layer.ffn.layer) is None:
            return f"layer {layer.ffn.layer}: the Triton expert kernels cannot run its records"
    return None


class CudaDecoder:
    def __init__(self, model, cache: KVCache, provider, *, graphs: bool = True):
        self.model, self.cache, self.provider, self.use_graphs = model, cache, provider, graphs
        dev, dtype, hidden = model.device, model.dtype, model.embed.shape[1]
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.long, device=dev)
        self.x = torch.zeros((1, hidden), dtype=dtype, device=dev)  # the residual stream between layers
        self.logits = torch.zeros((1, model.lm_head.shape[0]), dtype=torch.float32, device=dev)
        self.routed: dict[int, _Routed] = {}
        for i, layer in enumerate(model.layers):
            if isinstance(layer.ffn, MoEBlock):
                E, A = layer.ffn.num_experts, layer.ffn.top_k
                self.routed[i] = _Routed(
                    table=torch.full((E,), -1, dtype=torch.int32, device=dev),
                    ids_host=torch.zeros(A, dtype=torch.long).pin_memory(),
                    table_host=torch.full((E,), -1, dtype=torch.int32).pin_memory())
        self.ready = torch.cuda.Event()
        self.stream = torch.cuda.current_stream(dev)  # kept: asking costs ~25 us of CPU per call
        self.resident = False
        self._resident_tried = False
        self.graph_pool = torch.cuda.graph_pool_handle() if graphs else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}

    # -- segments (each reads and writes only static buffers) --------------------------------------
    def _start(self) -> None:
        self.x.copy_(F.embedding(self.token, self.model.embed))

    def _attention(self, i: int) -> None:
        layer = self.model.layers[i]
        h, hn = layer.decode_attention_half(self.x, self.pos, self.model.rope.inv_freq, self.cache, i)
        r = self.routed.get(i)
        if r is None:  # a dense FFN layer: finish it here
            self.x.copy_(layer.ffn(hn, residual=h))
            return
        # no copies into buffers of our own: inside a capture these are the graph's static outputs,
        # which the layer's experts segment (captured after this one) reads
        r.weights, r.ids = layer.ffn.route(hn)
        r.h, r.hn = h, hn

    def _experts(self, i: int) -> None:
        r, block = self.routed[i], self.model.layers[i].ffn
        layout = dispatch.triton_layout(r.hn, self.provider, block.layer)
        plan = dispatch.triton_module().MoEPlan(r.hn, r.ids, r.weights, block.num_experts, layout)
        plan.run_table(dispatch.slot_pool(self.provider, block.layer), r.table)
        if block.shared is None:
            plan.finish(r.h, out=self.x)
        else:
            self.x.copy_(block.add_shared(r.hn, plan.finish(), r.h))

    def _head(self) -> None:
        m = self.model
        self.logits.copy_(F.linear(td.rms_norm(self.x, m.final_norm, m.eps), m.lm_head))

    def _whole(self) -> None:
        self._start()
        for i in range(len(self.model.layers)):
            self._attention(i)
            if i in self.routed:
                self._experts(i)
        self._head()

    # -- running ----------------------------------------------------------------------------------
    def _replay(self, key: tuple, fn) -> None:
        """Run fn (a segment); with graphs, capture it on first use under `key` and replay it."""
        if not self.use_graphs:
            fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            stream = torch.cuda.Stream(self.x.device)
            saved = self.x.clone()  # a dense layer's segment updates x in place: run it once for real
            stream.wait_stream(torch.cuda.current_stream(self.x.device))
            with torch.cuda.stream(stream):  # warm up outside the capture (Triton compiles, cuBLAS plans)
                fn()
            torch.cuda.current_stream(self.x.device).wait_stream(stream)
            self.x.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.graph_pool):
                fn()
            self.graphs[key] = graph
        graph.replay()

    def _make_resident(self) -> None:
        """Switch to whole-step graphs once the cache has made every expert resident."""
        if self._resident_tried:
            return
        self._resident_tried = True
        tables = {i: self.provider.resident_table(self.model.layers[i].ffn.layer) for i in self.routed} \
            if hasattr(self.provider, "resident_table") else {}
        if tables and all(t is not None for t in tables.values()):
            for i, table in tables.items():
                self.routed[i].table.copy_(table)
            self.resident = True

    def step(self, token: int, position: int) -> torch.Tensor:
        """Logits [1, V] (float32, a static buffer: copy before the next step) of `token` at `position`."""
        self.token.fill_(token)
        self.pos.fill_(position)
        self._make_resident()
        if self.resident:
            self._replay(("step",), self._whole)
            for i, r in self.routed.items():
                block = self.model.layers[i].ffn
                self.provider.count_resident(block.layer, r.ids)
                if block.on_route is not None:
                    block.on_route(block.layer, r.ids)
        else:
            self._replay(("start",), self._start)
            for i in range(len(self.model.layers)):
                self._replay(("attention", i), lambda i=i: self._attention(i))
                if i in self.routed:
                    self._load(i)
                    try:
                        self._replay(("experts", i), lambda i=i: self._experts(i))
                    finally:  # a victim slot is rewritten only after the kernels queued above (stream order)
                        self.provider.release(self.model.layers[i].ffn.layer)
            self._replay(("head",), self._head)
        self.cache.length = position + 1
        return self.logits

    def _load(self, i: int) -> None:
        """The one host sync of a streamed layer: read its chosen ids, pin their slots (loading
        misses), and write its slot table."""
        r, block = self.routed[i], self.model.layers[i].ffn
        r.ids_host.copy_(r.ids.view(-1), non_blocking=True)
        self.ready.record(self.stream)
        self.ready.synchronize()
        if block.on_route is not None:
            block.on_route(block.layer, r.ids)
        experts = sorted(set(r.ids_host.tolist()))
        self.provider.fetch(block.layer, experts, views=False)
        r.table_host.numpy()[experts] = self.provider.slots_of(block.layer, experts)
        r.table.copy_(r.table_host, non_blocking=True)
