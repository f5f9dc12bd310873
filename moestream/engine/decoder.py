"""Steps of T tokens (T >= 1) for any family, from static buffers, replayed as CUDA graphs on CUDA.

On the GPU a decode step is bound by the host (a layer is ~20 small kernels, each costing more to
launch from Python than to run), so a step is cut into segments that never read a device value on
the host, each captured once and replayed: per layer "attention-rows" (the attention half for all
rows at once, a dense FFN, an MoE layer's router and shared expert) and per MoE layer "experts" (the
routed experts from the layer's slot table). The decoder knows only what every model has
(moestream.layers.transformer) and the RoutedExperts the MoE blocks share.

A row's bits never depend on T or on the rows beside it (speculative verification and batching rely
on it): on CUDA every product takes all MAX_STEP_TOKENS rows (moestream.kernels.triton_rows), on the
CPU one-row products batched; the expert kernels compute each (token, expert) pair on its own.

With every expert resident, or a device map (moestream.experts.device_map), the whole step is one
graph per T: no host work until the logits. Otherwise the host reads each layer's chosen ids (the one
sync per layer) and pins or loads the experts. Either way the same kernels run on the same bytes: the
same bits for every cache size. With graphs off (and on the CPU) the segments run eagerly."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from moestream.engine import timeline
from moestream.layers.experts import RoutedExperts
from moestream.kv.pool import KVPool
from moestream.layers.attention import row_linear
from moestream.layers.moe import MoEBlock
from moestream.layers.tile_products import tile_linear

MAX_STEP_TOKENS = 16  # tokens one step takes at most (longer lists are cut into steps)


@dataclass
class _Routed:
    """What an MoE layer's attention segment hands its experts segment, all the step's rows at once
    (inside a capture these are the graph's own static outputs)."""

    ids_host: torch.Tensor  # [MAX_STEP_TOKENS * A] int64 (pinned on CUDA)
    guesses_host: torch.Tensor | None = None
    weights: torch.Tensor | None = None  # [rows, A] routing weights
    ids: torch.Tensor | None = None  # [rows, A] int64 expert ids
    h: torch.Tensor | None = None  # [rows, H] residual stream after attention
    hn: torch.Tensor | None = None  # [rows, H] its normed copy, the experts' input
    shared: torch.Tensor | None = None  # [rows, H] the shared expert's output (or None)
    guesses: torch.Tensor | None = None  # [rows, depth * A'] later MoE layers' router top-k (lookahead)

    def rows(self, name: str, T: int) -> torch.Tensor | None:
        value = getattr(self, name)
        return None if value is None else value[:T]


class Decoder:
    def __init__(self, model, pool: KVPool, experts: RoutedExperts, *, graphs: bool = True, lookahead=None,
                 maps=None):
        """lookahead: a moestream.experts.predict.Lookahead (streamed one-token steps guess the next MoE
        layers' experts and start their copies early), or None; maps: GuessMaps correcting them."""
        self.model, self.pool, self.experts, self.lookahead = model, pool, experts, lookahead
        self.maps = maps
        dev, dtype = model.device, model.dtype
        self.cuda = dev.type == "cuda"
        self.use_graphs = graphs and self.cuda
        T = MAX_STEP_TOKENS
        # each row's token, position and sequence slot, filled from the host once per step (one copy)
        self._rows = torch.zeros((3, T), dtype=torch.long, device=dev)
        self.tokens, self.pos, self.row_slot = self._rows[0], self._rows[1], self._rows[2]
        # CUDA: two pinned staging copies in turn, each reused once the copy that read it has run
        self._staging = [torch.zeros((3, T), dtype=torch.long, pin_memory=True) for _ in range(2)] if self.cuda else []
        self._staged = [None, None]  # the event after each staging copy's last transfer
        self._turn = 0
        self.x = torch.zeros((T, model.hidden_size), dtype=dtype, device=dev)  # the residual stream
        self.logits = torch.zeros((T, model.vocab_size), dtype=torch.float32, device=dev)
        if self.cuda:  # head_rows' own fixed-shape input and output
            self.saved_x = torch.zeros_like(self.x)
            self.saved_logits = torch.zeros_like(self.logits)
        moe = [i for i, layer in enumerate(model.layers) if isinstance(layer.ffn, MoEBlock)]
        depth = lookahead.depth if lookahead is not None else 0
        self.ahead = {i: moe[n + 1:n + 1 + depth] for n, i in enumerate(moe)}  # layer -> the next MoE layers
        # per mode (segment graphs, or one whole-step graph per T): each graph has its own outputs
        self._modes: dict = {}
        self.routed: dict[int, _Routed] = self._mode("segments")
        self.ready = torch.cuda.Event() if self.cuda else None
        self.stream = torch.cuda.current_stream(dev) if self.cuda else None  # kept: asking costs ~25 us
        self.graph_pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        # a step's rows at once on CUDA serve short prompts too (Engine._prefill_by_steps)
        self.rows_at_once = self.cuda
        # the products over the step's rows: on CUDA over the fixed row tile (triton_rows), on the CPU
        # one-row products batched; either way a row's bits never depend on the rows beside it
        self.tile_linear = tile_linear if self.cuda else row_linear
        self._boundaries(self.cuda)

    def _boundaries(self, fuse: bool) -> None:
        """Fewer kernels where one layer ends and the next begins (CUDA): the post-attention norm also
        writes the experts' gemv input (`split_in[i]`); without a shared expert the expert sum also
        writes the next layer's input norm (`norm_after[i]`, into `normed`); the router product also
        takes the top-k (`fused_route`). Which layers do so follows from the model and the kernels
        alone, and every path of their experts ends in that same kernel: the same bits."""
        self.split_in: dict[int, torch.Tensor] = {}  # MoE layer -> its experts' gemv input [MAX_STEP_TOKENS, C, H/C]
        self.norm_after: dict[int, tuple] = {}  # MoE layer -> (weight, eps) of the next layer's input norm
        self.normed = None  # [MAX_STEP_TOKENS, H]: the next layer's normed input, written by the expert sum
        self.fused_route: dict[int, object] = {}  # MoE layer -> its router's kernel with the top-k
        if not fuse:
            return
        from moestream.kernels.triton_moe import split_shape
        from moestream.kernels.triton_route import MAX_FUSED_EXPERTS, route_rows

        counter = torch.zeros(1, dtype=torch.int32, device=self.x.device)  # route_rows' own: one launch at a time
        router = functools.partial(route_rows, counter=counter)

        layers, dtype, buffers = self.model.layers, self.model.dtype, {}
        for i, layer in enumerate(layers):
            block = layer.ffn
            if isinstance(block, MoEBlock) and block.fuses(dtype, MAX_FUSED_EXPERTS):
                self.fused_route[i] = router
            if not isinstance(block, MoEBlock) or not self.experts.uses_triton(block.layer, dtype) or \
                    not layer.writes_split:
                continue
            shape = split_shape(self.experts.layouts[block.layer], MAX_STEP_TOKENS)
            if shape not in buffers:  # one per shape: the layers run one after another
                buffers[shape] = torch.zeros(shape, dtype=torch.float32, device=self.x.device)
            self.split_in[i] = buffers[shape]
            nxt = layers[i + 1].rows_input_norm() if i + 1 < len(layers) else None
            if block.shared is None and nxt is not None:  # (a shared expert's sum runs in torch ops)
                self.norm_after[i] = nxt
        if self.norm_after:
            self.normed = torch.zeros_like(self.x)

    def _mode(self, key) -> dict[int, _Routed]:
        if key not in self._modes:
            routed = {}
            for i, layer in enumerate(self.model.layers):
                if isinstance(layer.ffn, MoEBlock):
                    ahead = sum(self.model.layers[j].ffn.top_k for j in self.ahead[i])
                    routed[i] = _Routed(
                        torch.zeros(MAX_STEP_TOKENS * layer.ffn.top_k, dtype=torch.long, pin_memory=self.cuda),
                        torch.zeros(ahead, dtype=torch.long, pin_memory=self.cuda) if ahead else None)
            self._modes[key] = routed
        return self._modes[key]

    @property
    def resident(self) -> bool:
        return self.experts.resident

    # -- segments (each reads and writes only static buffers) --------------------------------------
    def _start(self, T: int) -> None:
        self.x[:T].copy_(self.model.embed(self.tokens[:T]))

    def _attention_rows(self, i: int, T: int) -> None:
        """Layer i's attention half for the step's T rows at once (see the module doc)."""
        layer, kv = self.model.layers[i], self.pool.layer(i)
        x = self.x if self.cuda else self.x[:T]  # CUDA: the fixed row tile
        fused = {}
        if i - 1 in self.norm_after:
            fused["normed"] = self.normed
        if i in self.split_in:
            fused["split"] = self.split_in[i]
        h, hn = layer.attention_rows(x, self.pos[:T], self.row_slot[:T], kv, linear=self.tile_linear, **fused)
        r = self.routed.get(i)
        if r is None:  # a dense FFN layer: finish it here (over the tile on CUDA, row by row on the CPU)
            if self.cuda:
                self.x.copy_(layer.ffn(hn, residual=h))
            else:
                for t in range(T):
                    self.x[t:t + 1].copy_(layer.ffn(hn[t:t + 1], residual=h[t:t + 1]))
            return
        for name, value in self._route(i, h, hn, tile=T).items():
            setattr(r, name, value)

    def _route(self, i: int, h: torch.Tensor, hn: torch.Tensor, *, tile: int) -> dict:
        """An MoE layer's router (and the later layers' guessed routers) and shared expert on hn (on
        CUDA the row tile, whose first `tile` rows are the step's)."""
        block = self.model.layers[i].ffn
        over = {"linear": self.tile_linear}
        # (not where an instance attribute stands in for the method: moestream.engine.fit_lookahead's)
        fused = {"fused": functools.partial(self.fused_route[i], rows=tile)} \
            if i in self.fused_route and "route" not in vars(block) else {}
        weights, ids = block.route(hn, **over, **fused)
        guesses = None
        ahead = None if self.experts.device_driven else self.ahead.get(i)
        if ahead and (self.cuda or tile == 1):  # the later layers' routers on this input (top-k of logits)
            nxt = [self.model.layers[j].ffn for j in ahead]
            guesses = torch.cat([torch.topk(self._guess_logits(b, depth, hn, over), b.top_k, dim=-1).indices
                                 for depth, b in enumerate(nxt, start=1)], dim=-1)
        return {"weights": weights, "ids": ids, "h": h, "hn": hn, "shared": block.shared_out(hn, **over),
                "guesses": guesses}

    def _guess_logits(self, block: MoEBlock, depth: int, hn: torch.Tensor, over: dict) -> torch.Tensor:
        """block's router logits guessed from an expert input `depth` MoE layers earlier (fixed-shape ops)."""
        return block.router_logits(hn, **over) if self.maps is None else self.maps.logits(block, depth, hn)

    def _experts(self, i: int, T: int) -> None:
        r, block = self.routed[i], self.model.layers[i].ffn
        hn, h, shared = r.rows("hn", T), r.rows("h", T), r.rows("shared", T)
        ids, weights = r.rows("ids", T), r.rows("weights", T)
        if shared is None:  # the experts' last kernel adds the residual into x
            self.experts.compute(block.layer, hn, ids, weights, residual=h, out=self.x[:T],
                                 **self._fused_ends(i, T))
        else:
            routed = self.experts.compute(block.layer, hn, ids, weights, **self._fused_ends(i, T))
            self.x[:T].copy_(block.combine(routed, shared, h))

    def _fused_ends(self, i: int, T: int) -> dict:
        """The fused boundary's arguments of MoE layer i's experts for T rows (see `_boundaries`)."""
        out = {}
        if i in self.split_in:
            out["split_x"] = self.split_in[i][:T]
        if i in self.norm_after:
            out["norm"] = (*self.norm_after[i], self.normed[:T])
        return out

    def _head(self, T: int) -> None:
        if self.cuda:
            self.logits.copy_(self._tile_head(self.x))  # [MAX_STEP_TOKENS, V], whatever T
        else:
            self.logits[:T].copy_(self.head_rows(self.x[:T]))

    def _tile_head(self, x: torch.Tensor) -> torch.Tensor:
        """The head over the row tile x [MAX_STEP_TOKENS, H], its product on `tile_linear`."""
        return self.model.tile_head(x, self.tile_linear)

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] (float32; a static buffer on CUDA) of saved rows [n, H] of a head=False step,
        the bits a step's own head gives each row."""
        n = hidden.shape[0]
        if not 1 <= n <= MAX_STEP_TOKENS:
            raise ValueError(f"head_rows takes 1..{MAX_STEP_TOKENS} rows, not {n}")
        if not self.cuda:
            return self.model.head(hidden) if n == 1 else self.model.rows_head(hidden)
        self.saved_x[:n].copy_(hidden)
        self._replay(("saved-head",), lambda: self.saved_logits.copy_(self._tile_head(self.saved_x)))
        return self.saved_logits[:n]

    def _whole(self, T: int, head: bool = True) -> None:
        self._start(T)
        for i in range(len(self.model.layers)):
            self._attention_rows(i, T)
            if i in self.routed:
                self._experts(i, T)
        if head:
            self._head(T)

    # -- running ----------------------------------------------------------------------------------
    def _capturable(self, i: int) -> bool:
        return self.experts.uses_triton(self.model.layers[i].ffn.layer, self.model.dtype)

    def _replay(self, key: tuple, fn, *, capture: bool = True) -> None:
        """Run fn (a segment); with graphs, capture it on first use under `key` and replay it."""
        if not (self.use_graphs and capture):
            with timeline.segment(key):
                fn()
            return
        graph = self.graphs.get(key)
        if graph is None:
            stream = torch.cuda.Stream(self.x.device)
            saved = self.x.clone()  # a segment may update x in place: run it once for real
            stream.wait_stream(self.stream)
            with torch.cuda.stream(stream):  # warm up outside the capture (Triton compiles, cuBLAS plans)
                fn()
            self.stream.wait_stream(stream)
            self.x.copy_(saved)
            graph = torch.cuda.CUDAGraph()
            # thread_local: reader threads may start copies (early reads) while this thread captures
            with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
                fn()
            self.graphs[key] = graph
        with timeline.segment(key):
            graph.replay()

    def step_rows(self, tokens: list[int], positions: list[int], slots: list[int], *,
                  head: bool = True, device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, V] (float32, a static buffer: copy before the next step) of tokens[t] at
        positions[t] of sequence slots[t]; the caller records the tokens. head=False: the final
        residual stream [T, H]. device_tokens: the ids on the device, in place of `tokens`."""
        T = len(tokens)
        if not 1 <= T <= MAX_STEP_TOKENS:
            raise ValueError(f"a step takes 1..{MAX_STEP_TOKENS} tokens, not {T}")
        self._reserve(positions, slots)
        self._fill_rows(tokens, positions, slots)
        if device_tokens is not None:  # stream-ordered after the rows' copy, before anything reads them
            self.tokens[:T].copy_(device_tokens.reshape(-1)[:T])
        return self._step_at_once(T, all(s == slots[0] for s in slots), head)

    def _reserve(self, positions: list[int], slots: list[int]) -> None:
        """Blocks for the rows' positions in each of their sequences, then the device's block tables."""
        spans: dict[int, list[int]] = {}
        for pos, slot in zip(positions, slots):
            span = spans.setdefault(slot, [pos, pos + 1])
            span[0], span[1] = min(span[0], pos), max(span[1], pos + 1)
        for slot, (start, end) in spans.items():
            self.pool.sequences[slot].reserve(start, end)
        self.pool.sync()

    def _fill_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> None:
        """The step's tokens, positions and slots into the device rows the graphs read: on CUDA one copy
        from pinned memory (a staging copy is rewritten only after the copy that read it has run)."""
        T = len(tokens)
        host = self._staging[self._turn] if self.cuda else self._rows
        if self.cuda and self._staged[self._turn] is not None:
            self._staged[self._turn].synchronize()
        rows = host.numpy()
        rows[0, :T], rows[1, :T], rows[2, :T] = tokens, positions, slots
        if self.cuda:
            self._rows.copy_(host, non_blocking=True)
            event = self._staged[self._turn] or torch.cuda.Event()
            event.record(self.stream)
            self._staged[self._turn], self._turn = event, 1 - self._turn

    def _step_at_once(self, T: int, single: bool, head: bool) -> torch.Tensor:
        """One graph per T whatever sequences the rows come from, or per layer an attention segment,
        then its experts (eager on the CPU)."""
        key = ("step", T) if head else ("step", T, "hidden")
        if self.experts.device_driven and self.use_graphs and (single or self.experts.resident) and \
                all(self._capturable(i) for i in self.routed):
            self.routed = self._mode(key)
            self._replay(key, lambda: self._whole(T, head))
            self._booked_step(T)
            return self.logits[:T] if head else self.x[:T]
        self.routed = self._mode(("segments", T))
        self._replay(("start", T), lambda: self._start(T))
        for i in range(len(self.model.layers)):
            self._replay(("attention-rows", i, T), lambda i=i: self._attention_rows(i, T))
            if i in self.routed:
                self._run_experts(i, T)
        if not head:
            return self.x[:T]
        self._replay(("head",), lambda: self._head(T))
        return self.logits[:T]


    def _run_experts(self, i: int, T: int) -> None:
        """Host half (unless resident), then the layer's experts segment."""
        r, block = self.routed[i], self.model.layers[i].ffn
        capture = self._capturable(i)
        if self.experts.device_driven:
            self._replay(("experts", i, T), lambda: self._experts(i, T), capture=capture)
            self._booked(i, T)
            return
        ids = r.rows("ids", T)
        A = ids.shape[1]
        host = r.ids_host[:T * A]
        host.copy_(ids.view(-1), non_blocking=True)
        guessing = T == 1 and r.guesses_host is not None and r.guesses is not None
        if guessing:
            r.guesses_host.copy_(r.rows("guesses", 1).reshape(-1), non_blocking=True)
        if self.cuda:  # the one host sync of a streamed layer
            self.ready.record(self.stream)
            with timeline.span("sync", layer=block.layer):
                self.ready.synchronize()
        if self.experts.on_route is not None:
            self.experts.on_route(block.layer, ids)
        chosen = host.tolist()
        if self.lookahead is not None and T == 1:
            self.lookahead.score(block.layer, chosen)
        if not self.experts.load(block.layer, chosen):
            self._experts_in_batches(i, T)  # more distinct experts than the pool can pin at once
            return
        if guessing:  # this layer's experts are pinned: early copies cannot evict them
            flat, at = r.guesses_host.tolist(), 0
            for depth, j in enumerate(self.ahead[i], start=1):
                k = self.model.layers[j].ffn.top_k
                self.lookahead.guess(self.model.layers[j].ffn.layer, depth, flat[at:at + k])
                at += k
        try:
            self._replay(("experts", i, T), lambda: self._experts(i, T), capture=capture)
        finally:  # a victim slot is rewritten only after the kernels queued above (stream order)
            self.experts.release(block.layer)

    def _booked_step(self, T: int) -> None:
        """_booked for every MoE layer of a whole-step graph (resident: one count for all layers)."""
        if self.experts.resident:
            self.experts.count_resident_step([(self.model.layers[i].ffn.layer, self.routed[i].rows("ids", T))
                                              for i in self.routed])
        else:
            for i in self.routed:
                self._booked(i, T)

    def _booked(self, i: int, T: int) -> None:
        """A layer ran with no host half: book its resident hits (a device map counts its own), or
        show a routing trace the ids."""
        layer, ids = self.model.layers[i].ffn.layer, self.routed[i].rows("ids", T)
        if self.experts.resident:
            self.experts.count_resident_step([(layer, ids)])
        elif self.experts.on_route is not None:
            self.experts.on_route(layer, ids)

    def _experts_in_batches(self, i: int, T: int) -> None:
        r, block = self.routed[i], self.model.layers[i].ffn
        hn, h, shared = r.rows("hn", T), r.rows("h", T), r.rows("shared", T)
        if i in self.norm_after:  # the same last kernel as `_experts`
            self.experts(block.layer, hn, r.rows("ids", T), r.rows("weights", T), residual=h, per_pair=True,
                         notify=False, out=self.x[:T], norm=(*self.norm_after[i], self.normed[:T]))
            return
        routed = self.experts(block.layer, hn, r.rows("ids", T), r.rows("weights", T), per_pair=True,
                              notify=False)
        self.x[:T].copy_(block.combine(routed, shared, h))
