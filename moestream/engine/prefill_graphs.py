"""A fresh prompt's prefill chunk on CUDA as one CUDA graph per length bucket.

Why: at 512 tokens an eager prefill call costs about 50 ms of host launches against about 23 ms of
GPU work (H200, Qwen3-30B-A3B shape, every expert resident); a replay is one launch.

The chunk is padded to the next power of two with copies of its last token, after the real rows,
which keep their bits: causal attention hides the padding, the expert kernels choose their tiles for
the real token count (`RoutedExperts.padded`) and the padding's K/V land past the prompt. But
cuBLAS chooses its algorithm by row count, so padded rows differ in the last bits from unpadded ones:
wherever the mode pads (`takes`), every fresh chunk is padded, graph or not, and every MoE layer
routes the padding to the last real row's experts (`padding_on_last_row`). Resident hits are counted
after each replay for the real rows only, as the eager prefill counts them.
A graph replays (`replays`) only with every expert resident on the Triton kernels and no memory
budget (the graphs keep their activations)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from moestream.kv.pool import KVPool
from moestream.layers.moe import MoEBlock
from moestream.layers.transformer import MoETransformer

log = logging.getLogger(__name__)

SMALLEST = 32  # shorter prompts run as one decoder step (Engine._prefill_by_steps)


def bucket(tokens: int) -> int:
    """The padded length of a chunk of `tokens`: the next power of two, at least SMALLEST."""
    n = SMALLEST
    while n < tokens:
        n *= 2
    return n


def for_engine(model: MoETransformer, experts, options, device: torch.device, chunk: int, pool: KVPool, *,
               graphs: bool = True, workspace: Callable[[int], int] | None = None) -> "PrefillGraphs | None":
    """An engine's padded prefill on CUDA, None elsewhere; graphs are captured (on a key's second use)
    with CUDA graphs and no memory budget. workspace(tokens): a chunk's transient bytes."""
    if device.type != "cuda" or not PrefillGraphs.fits(pool):
        return None
    capture = graphs and options.memory_budget is None
    return PrefillGraphs(model, experts, pool, largest=max(1, chunk), capture=capture, capture_after=1,
                         workspace=workspace)


@dataclass
class _Graph:
    """A captured bucket: the graph, its static inputs, its logits, and each resident layer's
    (layer, expert ids) as the graph leaves them."""

    graph: torch.cuda.CUDAGraph
    ids: torch.Tensor
    last: torch.Tensor
    sequences: torch.Tensor
    logits: torch.Tensor
    routed: list


class PrefillGraphs:
    def __init__(self, model: MoETransformer, experts, pool: KVPool, *, largest: int, capture: bool = True,
                 capture_after: int = 0, workspace: Callable[[int], int] | None = None):
        """largest: the longest chunk taken. capture=False pads without capturing. capture_after:
        chunks of a key run eagerly before its capture (~0.2 s and more on the H200: a one-prompt run
        never pays it). workspace(tokens): a chunk's transient bytes, captured only where free."""
        self.model, self.experts, self.pool, self.largest, self.capture = model, experts, pool, largest, capture
        self.capture_after, self.workspace = capture_after, workspace
        self._short: set[int] = set()  # buckets left eager for want of memory (logged once)
        self._uses: dict[tuple, int] = {}  # a graph's key -> the chunks run eagerly before its capture
        self.graphs: dict[tuple, _Graph] = {}
        self.broken = False  # a capture failed: every later padded chunk runs eagerly
        self.graph_pool = torch.cuda.graph_pool_handle() if capture else None
        blocks = {(layer.ffn.top_k, layer.ffn.num_experts) for layer in model.layers if isinstance(layer.ffn, MoEBlock)}
        self._moe_shapes = sorted(blocks)

    @staticmethod
    def fits(pool: KVPool) -> bool:
        """Whether the model's prefill can be padded: no recurrent state the padding would advance."""
        return not pool.recurrent

    def takes(self, tokens: int, start: int, seq: int) -> bool:
        """Whether a chunk of `tokens` at `start` is padded (see the module doc). Nothing here may depend
        on the expert cache: the padding changes bits."""
        ex = self.experts
        return start == 0 and SMALLEST // 2 < tokens <= self.largest and bucket(tokens) <= self.pool.max_context and \
            ex.on_route is None and ex.reroute is None and ex.parallel is None and self.model.on_hidden is None

    def replays(self) -> bool:
        """Whether a padded chunk runs as a graph: every expert resident, no device map, every MoE layer
        on the Triton kernels (the torch reference reads ids on the host)."""
        ex = self.experts
        return self.capture and not self.broken and ex.resident and ex.device_map is None and self._capturable()

    def _capturable(self) -> bool:
        dtype = self.model.dtype
        return all(self.experts.uses_triton(layer.ffn.layer, dtype) for layer in self.model.layers
                   if isinstance(layer.ffn, MoEBlock))

    def _key(self, tokens: int) -> tuple:
        """(bucket, each MoE shape's row block, the expert kernels' mode)."""
        from moestream.kernels.triton_moe import DEFAULT_CONFIG, grouped_block_m

        dtype = self.model.dtype
        gemv = tokens <= DEFAULT_CONFIG.gemv_max_tokens  # the expert kernels' mode (a config may raise it)
        return (bucket(tokens),) + tuple(grouped_block_m(tokens, k, e, dtype) for k, e in self._moe_shapes) + (gemv,)

    def run(self, piece: list[int], seq: int) -> torch.Tensor:
        """Logits [1, V] (float32) of the last token of `piece`, prefilled at positions 0.. of sequence
        `seq`; the caller records the tokens in the cache."""
        T, padded = len(piece), bucket(len(piece))
        dev = self.model.device
        self.pool.sequences[seq].reserve(0, padded)  # the padding's rows too (overwritten before read)
        self.pool.sync()
        ids = torch.tensor(piece + [piece[-1]] * (padded - T), dtype=torch.long, device=dev)
        last = torch.tensor([T - 1], dtype=torch.long, device=dev)
        sequences = torch.full((padded,), seq, dtype=torch.long, device=dev)
        if not self.replays():
            return self._eager(ids, last, sequences, T)
        key = self._key(T)
        entry = self.graphs.get(key)
        if entry is None and self._uses.get(key, 0) < self.capture_after:
            self._uses[key] = self._uses.get(key, 0) + 1  # one prompt of a bucket never repays its capture
            return self._eager(ids, last, sequences, T)
        if entry is None and not self._room(padded):
            return self._eager(ids, last, sequences, T)
        if entry is None:
            t0 = time.perf_counter()
            try:
                entry = self._capture(ids, last, sequences, T)
            except Exception as exc:  # noqa: BLE001 - the padded chunk run eagerly gives the same logits
                log.warning("the prefill graph of %d tokens could not be captured (%s): padded prefills run eagerly",
                            padded, exc)
                self.broken = True
                torch.cuda.synchronize(dev)
                return self._eager(ids, last, sequences, T)
            self.graphs[key] = entry
            log.info("captured the prefill graph of %d tokens (row blocks %s) in %.1f s", padded, key[1:-1],
                     time.perf_counter() - t0)
        entry.ids.copy_(ids)
        entry.last.copy_(last)
        entry.sequences.copy_(sequences)
        entry.graph.replay()
        self._book(entry.routed, T)
        return entry.logits.clone()

    def _room(self, padded: int) -> bool:
        """Whether a bucket's graph fits beside what the device holds: its workspace estimate against
        the free memory and the allocator's unused cache (a capture empties that cache first)."""
        if self.workspace is None:
            return True
        dev = self.model.device
        free = torch.cuda.mem_get_info(dev)[0] + torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)
        need = self.workspace(padded)
        if free >= need:
            return True
        if padded not in self._short:
            self._short.add(padded)
            log.info("the prefill graph of %d tokens needs ~%.1f GB, %.1f GB free: its prompts prefill eagerly",
                     padded, need / 1e9, free / 1e9)
        return False

    def _eager(self, ids: torch.Tensor, last: torch.Tensor, sequences: torch.Tensor, tokens: int) -> torch.Tensor:
        routed: list = []
        logits = self._forward(ids, last, sequences, tokens, routed)
        self._book(routed, tokens)
        return logits

    def _forward(self, ids: torch.Tensor, last: torch.Tensor, sequences: torch.Tensor, tokens: int,
                 routed: list) -> torch.Tensor:
        """The padded chunk through the model; `routed` takes each resident layer's (layer, ids [padded, A])."""
        with self.experts.padded(tokens, last, routed):
            positions = torch.arange(ids.shape[0], device=ids.device)
            return self.model.forward(ids, positions, sequences, self.pool, last_row=last)

    def _book(self, routed: list, tokens: int) -> None:
        """The resident hits of the real rows (after the run, outside any graph; the padding's rows are
        not the prompt's)."""
        if routed:
            self.experts.count_resident_step([(layer, ids[:tokens]) for layer, ids in routed])

    def _capture(self, ids: torch.Tensor, last: torch.Tensor, sequences: torch.Tensor, tokens: int) -> _Graph:
        ids_in, last_in, seq_in = ids.clone(), last.clone(), sequences.clone()
        current = torch.cuda.current_stream(ids.device)
        side = torch.cuda.Stream(ids.device)
        side.wait_stream(current)
        with torch.cuda.stream(side):  # warm up outside the capture (Triton compiles, cuBLAS plans)
            self._forward(ids_in, last_in, seq_in, tokens, [])  # its hits are not booked: the replay's are
        current.wait_stream(side)
        graph, routed = torch.cuda.CUDAGraph(), []
        with torch.cuda.graph(graph, pool=self.graph_pool, capture_error_mode="thread_local"):
            logits = self._forward(ids_in, last_in, seq_in, tokens, routed)
        return _Graph(graph, ids_in, last_in, seq_in, logits, routed)
