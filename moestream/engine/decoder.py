"""Steps of T tokens (T >= 1) for any family, from static buffers, replayed as CUDA graphs on CUDA.

On the GPU a decode step is bound by the host: a layer is ~20 small kernels, each of which costs
more to launch from Python than to run. So a step is cut into segments that never read a device
value on the host, each captured once and replayed. The decoder knows only what every model has
(moestream.layers.transformer): `embed`, each layer's `attention_step` and `ffn`, `head`, and the
RoutedExperts the MoE blocks share:

  - per layer and token t, "attention": the layer's attention_step at the device position of t;
    a dense layer's FFN; an MoE layer's router top-k and shared expert (if any);
  - per MoE layer, "experts": the routed experts of the T tokens from the layer's device slot
    table, then shared expert and residual.

Layer by layer, token t's attention reads the K/V that tokens before it wrote a moment earlier, so
T tokens give exactly what T one-token steps give: every segment but the experts works on one
token, and the expert kernels compute each (token, expert) pair on its own (`per_pair`), so a
token's bits never depend on T. Speculative verification relies on this. The head is the same: on
CUDA one product over all MAX_STEP_TOKENS rows of the residual stream, whatever T (a fixed shape:
the weights are read once, and a row's bits never depend on the rows beside it), on the CPU one
row at a time (there a product's cost grows with its rows). A step can stop before the head
(`head=False`, the hot-vocabulary head's guesses); `head_rows` later gives saved rows' logits with
the bits the step's own head would have given them.

When every expert is resident (the cache holds them all), the slot tables never change, and the
whole step is one graph: no host work until the logits. The same holds with a device map
(moestream.experts.device_map): the experts segment first brings the layer's table up to date on
the device, copying misses from the host tier itself. Otherwise between a layer's attention
and its experts the host reads the chosen ids (the one sync per layer), pins or loads the experts
and writes the layer's slot table. Both ways run the same kernels on the same bytes, so the logits
are the same bits for every cache size; with graphs off (and on the CPU) the segments run eagerly.
Rows at once (CUDA, where every layer's attention is the plain kind the fused kernels compute;
`rows=False` turns it off): a layer's attention half runs once for all the step's rows rather
than row by row. Its products (q/k/v, o, router, shared expert, dense FFN) take all
MAX_STEP_TOKENS rows of the residual stream whatever T, like the head: a fixed shape, so a row's
bits never depend on T or on the rows beside it; the rotary/K/V-write kernel then the attention
kernels take the T rows, each with its own position and, with several sequences, its sequence
slot as a device value (the caches are one pool): one graph per T serves every arrangement of
sequences. Those products run on cuBLAS (F.linear) or, with rows_products="triton"
(--rows-products), on moestream.kernels.triton_rows (moestream.layers.tile_products): the same
kernels for every step, so the same bits for every cache size either way (the head's product
too; a dense FFN keeps F.linear). With the rows at once and the Triton expert kernels, a layer
boundary is one kernel: the expert sum (+ residual) also writes the next layer's input norm, and the
post-attention norm also writes the experts' float32 input (`_boundaries`). Row by row instead, a
step whose rows come from several sequences (batched serving) runs in segments, a graph per layer,
row and sequence; with every expert resident it becomes one graph too once the same arrangement of
sequences repeats (each such graph binds its rows' caches)."""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from moestream.engine import timeline
from moestream.layers.experts import RoutedExperts
from moestream.layers.kv_cache import KVCache
from moestream.layers.moe import MoEBlock
from moestream.layers.tile_products import tile_linear

MAX_STEP_TOKENS = 16  # tokens one step takes at most (longer lists are cut into steps)
MAX_BATCH_GRAPHS = 4  # whole-step graphs kept for steps whose rows come from several sequences


@dataclass
class _Routed:
    """What an MoE layer's attention segments hand its experts segment, one entry per token t
    (inside a capture these are the graph's own static outputs)."""

    ids_host: torch.Tensor  # [MAX_STEP_TOKENS * A] int64 (pinned on CUDA)
    weights: list = field(default_factory=list)  # [1, A] routing weights
    ids: list = field(default_factory=list)  # [1, A] int64 expert ids
    h: list = field(default_factory=list)  # [1, H] residual stream after attention
    hn: list = field(default_factory=list)  # [1, H] its normed copy, the experts' input
    shared: list = field(default_factory=list)  # [1, H] the shared expert's output (or None)
    guesses: list = field(default_factory=list)  # [1, depth * A'] later MoE layers' router top-k (lookahead)
    guesses_host: torch.Tensor | None = None
    # per row t, the sequence slot whose attention graph owns the tensors above (segment graphs
    # only): another slot's graph for row t copies its outputs into them, so one experts graph
    # serves rows of any slot
    owner: list = field(default_factory=list)
    whole: bool = False  # rows at once: entry 0 of each list holds every row [MAX_STEP_TOKENS, ...]

    def rows(self, name: str, T: int) -> torch.Tensor | None:
        parts = getattr(self, name)[:T]
        if parts[0] is None:
            return None
        if self.whole:
            return parts[0][:T]
        return parts[0] if T == 1 else torch.cat(parts)


class Decoder:
    def __init__(self, model, cache: KVCache | list[KVCache], experts: RoutedExperts, *, graphs: bool = True,
                 lookahead=None, maps=None, rows: bool = True, rows_products: str = "cublas",
                 fuse_boundaries: bool = True):
        """cache: one KV cache, or one per sequence slot (a step's rows may come from several).
        lookahead: a moestream.experts.predict.Lookahead, or None: streamed one-token steps then
        guess the next MoE layers' experts on the device and start their copies early.
        maps: moestream.experts.guess_maps.GuessMaps (on the model's device) that correct those guesses.
        rows: a step's rows at once where the model allows it (CUDA, every layer `takes_slot`, one
        cache or a pool of them); False: row by row.
        rows_products: the kernel of the rows-at-once step's products over its row tile, "cublas" or
        "triton" (moestream.layers.tile_products); row by row they stay F.linear.
        fuse_boundaries: with the rows at once, the kernels that end a layer also write what the next
        kernels read (see `_boundaries`); False: each its own kernel, as before (A/B comparisons)."""
        self.caches = list(cache) if isinstance(cache, (list, tuple)) else [cache]
        self.model, self.cache, self.experts, self.lookahead = model, self.caches[0], experts, lookahead
        self.maps = maps
        dev, dtype = model.device, model.dtype
        self.cuda = dev.type == "cuda"
        self.use_graphs = graphs and self.cuda
        T = MAX_STEP_TOKENS
        # each row's token, position and sequence slot, filled from the host once per step (one copy)
        self._rows = torch.zeros((3, T), dtype=torch.long, device=dev)
        self.tokens, self.pos = self._rows[0], self._rows[1]
        # CUDA: two pinned staging copies in turn, each reused once the copy that read it has run
        self._staging = [torch.zeros((3, T), dtype=torch.long, pin_memory=True) for _ in range(2)] if self.cuda else []
        self._staged = [None, None]  # the event after each staging copy's last transfer
        self._turn = 0
        self.x = torch.zeros((T, model.hidden_size), dtype=dtype, device=dev)  # the residual stream
        self.logits = torch.zeros((T, model.vocab_size), dtype=torch.float32, device=dev)
        if self.cuda:  # head_rows' own fixed-shape input and output
            self.saved_x = torch.zeros_like(self.x)
            self.saved_logits = torch.zeros_like(self.logits)
        self.row_slots = [0] * T  # the sequence slot (KV cache) of each row of the current step
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
        self._last_batch: tuple | None = None  # the key of the last step of several sequences' rows
        pool = self.caches[0].pool
        pooled = pool is not None and all(c.pool is pool for c in self.caches)
        self.rows_at_once = rows and self.cuda and (len(self.caches) == 1 or pooled) and \
            all(getattr(layer, "takes_slot", lambda: False)() for layer in model.layers)
        # the row tile's products (q/k/v, o, router, shared expert, head) with the rows at once
        self.tile_linear = tile_linear(rows_products) if self.rows_at_once else tile_linear("cublas")
        # each row's sequence slot as the kernels read it (rows at once over a pool), filled like pos
        self.row_slot = self._rows[2] if self.rows_at_once and pooled else None
        # the CPU's rows at once: a step of one sequence's T > 1 rows through each layer's cpu_rows
        self.cpu_rows = rows and not self.cuda and \
            all(getattr(layer, "takes_cpu_rows", lambda dtype: False)(dtype) for layer in model.layers)
        self._boundaries(fuse_boundaries and self.rows_at_once)

    def _boundaries(self, fuse: bool) -> None:
        """Fewer kernels where one layer ends and the next begins (with the rows at once):
          - (Triton expert kernels) a layer's post-attention norm also writes the experts' gemv input
            (MoEPlan's split_x) into `split_in[i]`, which the experts then read in place of a copy
            kernel of their own;
          - (Triton expert kernels, no shared expert) a layer's expert sum (+ residual) also writes the
            next layer's input norm into `normed` (`norm_after[i]`), which that layer's attention then
            takes in place of its own norm kernel;
          - with the Triton row products, the router product also takes the top-k (`fused_route`:
            moestream.kernels.triton_route.route_rows).
        Which layers do so follows from the model and the expert kernels alone, never from the cache,
        and every path of those layers' experts (resident, streamed, in batches, with a CPU share) ends
        in that same kernel: the bits stay the same for every cache size."""
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
            if isinstance(block, MoEBlock) and self.tile_linear is not F.linear and \
                    type(block).route is MoEBlock.route and block.fuses(dtype, MAX_FUSED_EXPERTS):
                self.fused_route[i] = router
            if not isinstance(block, MoEBlock) or not self.experts.uses_triton(block.layer, dtype):
                continue
            shape = split_shape(self.experts.layouts[block.layer], MAX_STEP_TOKENS)
            if shape not in buffers:  # one per shape: the layers run one after another
                buffers[shape] = torch.zeros(shape, dtype=torch.float32, device=self.x.device)
            self.split_in[i] = buffers[shape]
            nxt = layers[i + 1].rows_input_norm() if i + 1 < len(layers) and \
                hasattr(layers[i + 1], "rows_input_norm") else None
            if block.shared is None and nxt is not None:  # (a shared expert's sum runs in torch ops)
                self.norm_after[i] = nxt
        if self.norm_after:
            self.normed = torch.zeros_like(self.x)

    def _mode(self, key) -> dict[int, _Routed]:
        if key not in self._modes:
            routed = {}
            for i, layer in enumerate(self.model.layers):
                if isinstance(layer.ffn, MoEBlock):
                    ids_host = torch.zeros(MAX_STEP_TOKENS * layer.ffn.top_k, dtype=torch.long)
                    routed[i] = _Routed(ids_host.pin_memory() if self.cuda else ids_host)
                    for name in ("weights", "ids", "h", "hn", "shared", "guesses", "owner"):
                        setattr(routed[i], name, [None] * MAX_STEP_TOKENS)
                    ahead = sum(self.model.layers[j].ffn.top_k for j in self.ahead[i])
                    if ahead:
                        routed[i].guesses_host = torch.zeros(ahead, dtype=torch.long, pin_memory=self.cuda)
            self._modes[key] = routed
        return self._modes[key]

    @property
    def resident(self) -> bool:
        return self.experts.resident

    # -- segments (each reads and writes only static buffers) --------------------------------------
    def _start(self, T: int) -> None:
        self.x[:T].copy_(self.model.embed(self.tokens[:T]))

    def _attention(self, i: int, t: int) -> None:
        layer, x, slot = self.model.layers[i], self.x[t:t + 1], self.row_slots[t]
        h, hn = layer.attention_step(x, self.pos[t:t + 1], self.caches[slot], i)
        r = self.routed.get(i)
        if r is None:  # a dense FFN layer: finish it here
            x.copy_(layer.ffn(hn, residual=h))
            return
        outs = self._route(i, h, hn)
        owner = r.owner[t]
        if owner is None or owner == slot:
            for name, value in outs.items():
                getattr(r, name)[t] = value
        else:  # row t's tensors belong to another slot's graph, which the experts graph reads
            for name, value in outs.items():
                if value is not None:
                    getattr(r, name)[t].copy_(value)

    def _attention_rows(self, i: int, T: int) -> None:
        """Layer i's attention half for the step's T rows at once (rows at once; see the module doc)."""
        layer = self.model.layers[i]
        slot = None if self.row_slot is None else self.row_slot[:T]
        fused = {}
        if i - 1 in self.norm_after:
            fused["normed"] = self.normed
        if i in self.split_in:
            fused["split"] = self.split_in[i]
        h, hn = layer.attention_rows(self.x, self.pos, self.caches[0], i, T, slot=slot, linear=self.tile_linear,
                                     **fused)
        r = self.routed.get(i)
        if r is None:  # a dense FFN layer: finish it here
            self.x.copy_(layer.ffn(hn, residual=h))
            return
        for name, value in self._route(i, h, hn, tile=T).items():
            getattr(r, name)[0] = value
        r.whole = True

    def _route(self, i: int, h: torch.Tensor, hn: torch.Tensor, *, tile: int = 0) -> dict:
        """An MoE layer's router (and the later layers' guessed routers) and shared expert on hn
        (tile: the rows-at-once step's row tile, of which the first `tile` rows are the step's, its
        products on `tile_linear`)."""
        block = self.model.layers[i].ffn
        # only a kernel other than F.linear is passed: a family's own route/shared_out need not take it
        over = {"linear": self.tile_linear} if tile and self.tile_linear is not F.linear else {}
        # (not where an instance attribute stands in for the method: moestream.engine.fit_lookahead's)
        fused = {"fused": functools.partial(self.fused_route[i], rows=tile)} \
            if tile and i in self.fused_route and "route" not in vars(block) else {}
        weights, ids = block.route(hn, **over, **fused)
        guesses = None
        ahead = None if self.experts.device_driven else self.ahead.get(i)
        if ahead:  # the later layers' routers on this input (top-k of logits)
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
        if self.routed[i].whole and i in self.split_in:
            out["split_x"] = self.split_in[i][:T]
        if i in self.norm_after:
            out["norm"] = (*self.norm_after[i], self.normed[:T])
        return out

    def _head(self, T: int) -> None:
        if self.cuda:
            self.logits.copy_(self._tile_head(self.x))  # [MAX_STEP_TOKENS, V], whatever T
        elif T == 1:
            self.logits[:1].copy_(self.model.head(self.x[:1]))
        else:
            self.logits[:T].copy_(self.model.rows_head(self.x[:T]))

    def _tile_head(self, x: torch.Tensor) -> torch.Tensor:
        """The head over the row tile x [MAX_STEP_TOKENS, H], its product on `tile_linear`."""
        tile_head = getattr(self.model, "tile_head", None)
        return self.model.head(x) if tile_head is None else tile_head(x, self.tile_linear)

    def _saved_head(self) -> None:
        self.saved_logits.copy_(self._tile_head(self.saved_x))

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] (float32; a static buffer on CUDA) of saved residual-stream rows [n, H]
        (`step(..., head=False)`'s), the bits a step's own head gives each row."""
        n = hidden.shape[0]
        if not 1 <= n <= MAX_STEP_TOKENS:
            raise ValueError(f"head_rows takes 1..{MAX_STEP_TOKENS} rows, not {n}")
        if not self.cuda:
            return self.model.head(hidden) if n == 1 else self.model.rows_head(hidden)
        self.saved_x[:n].copy_(hidden)
        self._replay(("saved-head",), self._saved_head)
        return self.saved_logits[:n]

    def _whole(self, T: int, head: bool = True) -> None:
        self._start(T)
        for i in range(len(self.model.layers)):
            if self.rows_at_once:
                self._attention_rows(i, T)
            else:
                for t in range(T):
                    self._attention(i, t)
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

    def step(self, tokens: list[int], start: int, *, slot: int = 0, head: bool = True,
             device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, V] (float32, a static buffer: copy before the next step) of `tokens` at
        positions start.. of sequence `slot`, T <= MAX_STEP_TOKENS. The caller records the tokens
        in the KV cache. head=False: stop before the head and return the final residual stream
        [T, H] (a static buffer too; `head_rows` turns saved rows into logits).
        device_tokens: the T token ids as a tensor on the model's device, in place of `tokens` (the
        host has not read them: the step is queued behind the work that computes them)."""
        return self.step_rows(tokens, [start + t for t in range(len(tokens))], [slot] * len(tokens), head=head,
                              device_tokens=device_tokens)

    def step_rows(self, tokens: list[int], positions: list[int], slots: list[int], *,
                  head: bool = True, device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [T, V] as `step`, row t being token tokens[t] at positions[t] of sequence slots[t]
        (a sequence's rows in order of position). The layers' experts run once for all rows; a
        row's bits are those it gets in a step of its own. head=False: the rows [T, H] before the head."""
        T = len(tokens)
        if not 1 <= T <= MAX_STEP_TOKENS:
            raise ValueError(f"a step takes 1..{MAX_STEP_TOKENS} tokens, not {T}")
        self._fill_rows(tokens, positions, slots)
        if device_tokens is not None:  # stream-ordered after the rows' copy, before anything reads them
            self.tokens[:T].copy_(device_tokens.reshape(-1)[:T])
        first = slots[0]
        single = all(s == first for s in slots)
        if self.rows_at_once:
            return self._step_at_once(T, single, head)
        if self.cpu_rows and single and T > 1:
            return self._cpu_rows_step(T, positions[0], first, head)
        # a whole-step graph binds the caches of its rows' sequences: one per sequence, and one per
        # arrangement of several sequences' rows once it repeats (a batch that keeps its members);
        # until then such a step runs in segments (graphs per layer, row and sequence, which any
        # arrangement reuses): capturing every new arrangement whole would cost more
        key = (("step", T) if first == 0 else ("step", T, first)) if single else ("step", T, tuple(slots))
        key = key if head else key + ("hidden",)
        whole = single or key in self.graphs or key == self._last_batch
        self._last_batch = None if single else key
        if whole and self.experts.device_driven and self.use_graphs and (single or self.experts.resident) and \
                all(self._capturable(i) for i in self.routed):
            if not single and key not in self.graphs:
                self._forget_batch_graphs()
            self.routed = self._mode(key)
            self._replay(key, lambda: self._whole(T, head))
            self._booked_step(T)
            return self.logits[:T] if head else self.x[:T]
        self.routed = self._mode("segments")
        self._replay(("start", T), lambda: self._start(T))
        for i in range(len(self.model.layers)):
            r = self.routed.get(i)
            for t in range(T):
                slot = slots[t]
                self._replay(("attention", i, t, slot), lambda i=i, t=t: self._attention(i, t))
                if r is not None and self.use_graphs and r.owner[t] is None:
                    r.owner[t] = slot
            if r is not None:
                self._run_experts(i, T)
        if not head:
            return self.x[:T]
        self._replay(("head",) if self.cuda else ("head", T), lambda: self._head(T))
        return self.logits[:T]

    def _cpu_rows_step(self, T: int, start: int, slot: int, head: bool) -> torch.Tensor:
        """step_rows for T > 1 rows of one sequence on the CPU: each layer's attention half once for
        all rows (DecoderLayer.cpu_rows), then per row its router (or dense FFN), then the layer's
        experts for all rows; every row's bits those of a step of its own."""
        self.routed = self._mode("segments")
        self._start(T)
        cache = self.caches[slot]
        for i, layer in enumerate(self.model.layers):
            with timeline.segment(("attention-rows", i, T)):
                h, hn = layer.cpu_rows(self.x[:T], start, cache, i)
                r = self.routed.get(i)
                for t in range(T):
                    if r is None:  # a dense FFN layer: finish it here
                        self.x[t:t + 1].copy_(layer.ffn(hn[t:t + 1], residual=h[t:t + 1]))
                        continue
                    for name, value in self._route(i, h[t:t + 1], hn[t:t + 1]).items():
                        getattr(r, name)[t] = value
            if r is not None:
                self._run_experts(i, T)
        if not head:
            return self.x[:T]
        with timeline.segment(("head", T)):
            self._head(T)
        return self.logits[:T]

    def _fill_rows(self, tokens: list[int], positions: list[int], slots: list[int]) -> None:
        """The step's tokens, positions and slots into the device rows the graphs read: one copy
        from pinned memory on CUDA (no sync: a staging copy is rewritten only after the copy that read
        it two steps ago has run), rather than a fill kernel per row and field."""
        T = len(tokens)
        self.row_slots[:T] = slots
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
        """step_rows with the rows at once: one graph per T whatever sequences the rows come from
        (their slots are device values), or per layer an attention segment for all rows, then its experts."""
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

    def _forget_batch_graphs(self) -> None:
        """Keep at most MAX_BATCH_GRAPHS - 1 graphs of several sequences' rows before capturing
        another (the oldest go: a batch that changed members rarely comes back)."""
        batches = [k for k in self.graphs if k[0] == "step" and len(k) > 2 and isinstance(k[2], tuple)]
        for key in batches[:max(0, len(batches) - MAX_BATCH_GRAPHS + 1)]:
            del self.graphs[key]
            self._modes.pop(key, None)

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
        guessing = T == 1 and r.guesses_host is not None and r.guesses[0] is not None
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
        if not self.experts.load(block.layer, chosen, r.rows("hn", T)):
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
        """A layer ran with no host half: resident hits are booked here (a device map counts its
        own); a routing trace still sees the ids."""
        layer, ids = self.model.layers[i].ffn.layer, self.routed[i].rows("ids", T)
        if self.experts.resident:
            self.experts.count_resident(layer, ids)
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
