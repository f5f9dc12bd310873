"""The engine: a packed model, its expert provider, a KV cache and the generation loop.

An Engine has `max_sequences` sequence slots (moestream.engine.sequences); slot 0 is the default one.
Several slots decode together through `step_many`: the experts one step routes to are loaded once
for all of them, and each sequence gets the bits it gets alone. A slot reuses the longest common
token prefix of the next prompt, so a chat that re-sends its history prefills only the new part.
Beside it: expert_setup.py (how experts reach the compute) and generation.py (`generate`)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import torch

from moestream.engine import expert_setup, generation, prefill_graphs, timeline
from moestream.engine.budget import prefill_workspace
from moestream.engine.decoder import MAX_STEP_TOKENS, Decoder
from moestream.engine.emitter import Emitter
from moestream.engine.generation import Generation
from moestream.engine.options import EngineOptions
from moestream.engine.plan import plan_run, resolve_expert_source, resolve_options
from moestream.engine.sampling import argmax_rows
from moestream.engine.sequences import PromptTooLongError, SequenceSlots
from moestream.engine.tokenizer import load_tokenizer
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError
from moestream.experts.cache import ExpertCache
from moestream.experts.predict import Lookahead
from moestream.experts.trace import TraceRecorder
from moestream.experts.unpacked import UnpackedExperts
from moestream.experts.sources import open_source
from moestream.format.reader import PackedModel
from moestream.kv.pool import KVRoom, SequenceKV
from moestream.layers.experts import RoutedExperts
from moestream.models.registry import build_model

if TYPE_CHECKING:
    from moestream.engine.speculative import SpeculativeOptions

log = logging.getLogger(__name__)
DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo" / "model"
DEMO_CACHE_SIZE = "30%"  # smaller than the demo model, so its first run really streams experts
WORKSPACE_SLACK = 256 << 20  # cached-but-free device bytes kept after a prefill
UNREAD = -1  # a cached position's id while the host has not read it yet (step_unread, then name_token)


class Engine:
    """A packed model ready to run: prefill a prompt, step T tokens, roll the KV cache back;
    `generate`, speculative decoding and batching build on these pieces."""

    def __init__(self, packed: PackedModel, options: EngineOptions, *, default_cache_size: str = "auto",
                 graphs: bool = True, prefetch: bool = True, digest_dir: str | None = None,
                 reroute: Callable | None = None, streaming: str = "auto"):
        """graphs=False runs CUDA steps and prefills eagerly (the same bits); prefetch=False loads
        experts on demand only (exact miss counts); digest_dir: where the resident files' digests are
        remembered; reroute(args, device): a benchmark's routing (moestream.bench.routing); streaming:
        auto (device-driven where it can run on CUDA, else host-driven), or "device" / "host" for tests
        that compare the two paths' bits or run the device path's protocol on the CPU."""
        self.packed, self.options, self.digest_dir = packed, options, digest_dir
        self.streaming_mode = streaming
        self.plan = plan_run(packed, options, default_cache_size=default_cache_size, digest_dir=digest_dir)
        self.device, self.dtype, self.max_context = self.plan.device, self.plan.dtype, self.plan.max_context
        self.model_name = packed.directory.name if packed.directory != DEMO_MODEL else "moestream-demo"
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        self.parallel = expert_setup.expert_parallel(packed, options)
        slots = self.plan.slots
        if self.parallel is not None:  # a rank never needs more slots than the experts it owns
            slots = max(1, min(slots, self.parallel.placement.count(self.parallel.group.rank)))
        source = open_source(resolve_expert_source(options.expert_source, self.device), packed,
                             check_records=options.verify)
        self.provider = ExpertCache(packed, self.device, slots=slots, source=source,
                                    policy=self.plan.cache_policy, host_slots=self.plan.host_slots, host_policy=options.host_cache_policy,
                                    staging_buffers=self.plan.staging,
                                    device_policy="lru" if options.cache_policy == "lru" else "cycle",
                                    timeline=timeline)
        if self.parallel is not None:
            from moestream.layers.expert_parallel import OwnedExperts

            self.provider = OwnedExperts(self.provider, self.parallel.placement, self.parallel.group.rank)
        self.trace = None
        try:
            def make_experts(args):  # the decoder's MoE layers and the multi-token-prediction layers' experts
                layers = args.moe_layers() + args.mtp_expert_layers(packed.manifest.mtp_layers)
                if options.trace_routing:
                    self.trace = TraceRecorder({"model": self.model_name, "family": packed.family,
                                                "num_experts": args.num_experts, "top_k": args.num_experts_per_tok,
                                                "moe_layers": args.moe_layers(), "num_layers": args.num_hidden_layers})
                unpacked = UnpackedExperts(self.plan.unpacked, entry_bytes=self.plan.unpacked_bytes) \
                    if self.plan.unpacked else None  # CPU runs: kept dequantized experts (the same bits)
                return RoutedExperts(self.provider, {i: args.num_experts for i in layers}, device=self.device,
                                     parallel=self.parallel, unpacked=unpacked,
                                     cpu_share=expert_setup.share_request(options, parallel=self.parallel,
                                                                          hidden=args.hidden_size, dtype=self.dtype),
                                     on_route=self._record_route if options.trace_routing else None,
                                     reroute=None if reroute is None else reroute(args, self.device))

            self.args, self.experts, self.model = build_model(packed, make_experts, device=self.device,
                                                              dtype=self.dtype)
            self.guess_maps = None if not prefetch else \
                expert_setup.load_guess_maps(packed, options, self.model, hidden_size=self.args.hidden_size,
                                             device=self.device)
            lookahead = Lookahead(self.provider, depth=1) if prefetch else None
            self.tokenizer = load_tokenizer(packed.directory, packed.config)
        except BaseException:
            self.provider.close()
            raise
        self.sequences = SequenceSlots(self.args.kv_layout(), self.max_context, count=options.max_sequences,
                                       dtype=self.dtype, device=self.device, prefill_chunk=self.plan.prefill_chunk)
        self.pool, self.caches = self.sequences.pool, self.sequences.caches
        self.decoder = Decoder(self.model, self.pool, self.experts, graphs=graphs, lookahead=lookahead,
                               maps=self.guess_maps)
        item = torch.finfo(self.dtype).bits // 8
        self.prefill_graphs = prefill_graphs.for_engine(
            self.model, self.experts, options, self.device, self.plan.prefill_chunk, self.pool, graphs=graphs,
            workspace=lambda tokens: prefill_workspace(self.args, tokens=tokens, context=self.max_context, item=item))
        self._resident_checked = False
        self._warmed: set[int] = set()  # row counts whose step graphs warm_steps captured
        # sees the final residual stream (before the final norm) of every position slot 0 computes:
        # hidden_tap(first position, rows [T, H]); the MTP drafter's input (moestream.engine.mtp_drafter)
        self.hidden_tap: Callable[[int, torch.Tensor], None] | None = None
        self._position = 0  # first position of the chunk being run (for routing traces)

    def _record_route(self, layer: int, ids: torch.Tensor) -> None:
        self.trace.record(layer, self._position, ids.cpu().numpy())

    @property
    def lookahead(self):
        """The Lookahead scoring the decoder's guesses, or None."""
        return self.decoder.lookahead

    @property
    def cache(self) -> SequenceKV:
        """Slot 0's KV cache (the default sequence)."""
        return self.caches[0]

    def save_trace(self) -> None:
        if self.trace is not None:
            self.trace.to_trace().save(self.options.trace_routing)

    def close(self) -> None:
        self.save_trace()
        self.experts.close()
        self.provider.close()

    @classmethod
    def load(cls, model_dir: str | Path | None = None, *, options: EngineOptions | None = None,
             graphs: bool = True, prefetch: bool = True, digest_dir: str | None = None,
             streaming: str = "auto") -> "Engine":
        packed, default_size = open_packed(model_dir)
        return cls(packed, options or EngineOptions(), default_cache_size=default_size, graphs=graphs,
                   prefetch=prefetch, digest_dir=digest_dir, streaming=streaming)

    # -- running the model: prefill, step, rollback -----------------------------------------
    def _make_resident(self) -> None:
        """Where the device cache has a slot for every expert, load them all once (no layer then needs
        a lookup or a host sync); else start streaming."""
        if self._resident_checked:
            return
        self._resident_checked = True
        if self.provider.can_hold_all():
            t0 = time.perf_counter()
            self.experts.make_resident()
            log.info("all %d experts resident on %s (%.1f s)", self.provider.total_experts, self.device,
                     time.perf_counter() - t0)
            return
        expert_setup.start_streaming(self)

    @property
    def streaming(self) -> str:
        """How routed experts reach the device: resident, device (the device map) or host."""
        return "resident" if self.experts.resident else "device" if self.experts.device_map is not None else "host"

    # -- sequence slots (moestream.engine.sequences) ------------------------------------------
    @property
    def open_sequences(self) -> list[int]:
        return self.sequences.open_ids

    def open_sequence(self, prefix: list[int] | None = None, *, slot: int | None = None,
                      tokens: int | None = None) -> int:
        """SequenceSlots.open: a free slot opened for `prefix` (the prompt to come), its shared start
        kept; `tokens`, the positions it may reach, kept free for it (kv_room)."""
        if tokens is not None:
            tokens = self._reach(prefix or [], tokens)
        return self.sequences.open(prefix, slot=slot, tokens=tokens)

    def kv_room(self, prompt_ids: list[int], max_new_tokens: int, *, share: bool = True) -> KVRoom:
        """SequenceSlots.room of a new sequence of `prompt_ids` and up to `max_new_tokens` more (a caller
        that opens one only where it `.fits` never runs out of blocks); `share` False: computed whole."""
        tokens = self._reach(prompt_ids, len(prompt_ids) + max(0, max_new_tokens))
        return self.sequences.room(list(prompt_ids), tokens, share=share)

    def _reach(self, prompt_ids: list[int], tokens: int) -> int:
        """The positions a sequence of `tokens` for `prompt_ids` holds blocks for: a first prefill chunk
        padded to its graph's bucket holds the padding's too (prefill_graphs.run)."""
        first = min(len(prompt_ids), max(1, self.plan.prefill_chunk))
        if self.prefill_graphs is not None and first > 0 and self.prefill_graphs.takes(first, 0, 0):
            return max(tokens, prefill_graphs.bucket(first))
        return tokens

    def close_sequence(self, seq: int) -> None:
        """Free slot `seq` for open_sequence (its cached tokens stay, for a later prompt's prefix)."""
        self.sequences.close(seq)

    def prefill(self, prompt_ids: list[int], *, seq: int = 0, should_stop: Callable[[], bool] | None = None,
                all_logits: bool = False) -> tuple[torch.Tensor | None, int]:
        """Bring sequence `seq`'s KV cache to `prompt_ids`, reusing the cached prefix; returns (logits
        [T, V] of the computed positions with all_logits, else [1, V] of the last; tokens reused), or
        (None, reused) if should_stop interrupted it."""
        cache = self.sequences.open_cache(seq)
        reuse = cache.truncate(0) if all_logits else self._reuse(cache, prompt_ids, seq)
        self.sequences.check_room(len(prompt_ids) - reuse, cache)
        if self._prefill_by_steps(len(prompt_ids) - reuse, seq):  # a few tokens: one step's graph
            if should_stop is not None and should_stop():
                return None, reuse
            logits = self._step(prompt_ids[reuse:], seq, head=True)
            return (logits if all_logits else logits[-1:]), reuse
        chunk = max(1, self.plan.prefill_chunk)
        outputs = []
        self.model.on_hidden = self.hidden_tap if seq == 0 else None
        try:
            with torch.inference_mode():
                self._make_resident()
                for start in range(reuse, len(prompt_ids), chunk):
                    if should_stop is not None and should_stop():
                        return None, reuse
                    piece = prompt_ids[start:start + chunk]
                    self._position = start
                    with timeline.span("prefill_chunk", position=start, tokens=len(piece)):
                        if self.prefill_graphs is not None and not all_logits and \
                                self.prefill_graphs.takes(len(piece), start, seq):
                            outputs.append(self.prefill_graphs.run(piece, seq))
                        else:
                            cache.reserve(start, start + len(piece))
                            self.pool.sync()
                            ids = torch.tensor(piece, dtype=torch.long, device=self.device)
                            positions = torch.arange(start, start + len(piece), device=self.device)
                            outputs.append(self.model.forward(ids, positions, torch.full_like(positions, seq),
                                                              self.pool, all_logits=all_logits))
                    cache.append(piece)
        finally:
            self.model.on_hidden = None
        self.release_workspace()
        return (torch.cat(outputs) if all_logits else outputs[-1]), reuse

    def prompt_step(self, prompt_ids: list[int], *, seq: int, beside: int) -> list[int] | None:
        """The prompt tokens `prefill(prompt_ids, seq=seq)` would run as one decoder step, for a caller
        to run in a `step_many` beside `beside` other rows (the cache brought to the reused start).
        None where prefill would run a pass or the step has no room: then call prefill."""
        rows = MAX_STEP_TOKENS - beside
        cache = self.sequences.open_cache(seq)
        reuse = self._reuse(cache, prompt_ids, seq)  # less where a recurrent layer keeps no state there
        new = len(prompt_ids) - reuse
        if new > rows or not self._prefill_by_steps(new, seq):
            return None
        self.sequences.check_room(new, cache)
        return list(prompt_ids[reuse:])

    def greedy_choices(self, rows: list[torch.Tensor]) -> list[int]:
        """Each logits row's greedy choice, with one wait for the device (sampling.argmax_rows)."""
        return argmax_rows(rows)

    def _reuse(self, cache: SequenceKV, prompt_ids: list[int], seq: int) -> int:
        """Keep the start of `prompt_ids` the cache holds, less its last token (its logits start
        decoding), less one more where the hidden tap must see the state before it; returns its length."""
        reuse = cache.reuse(prompt_ids, len(prompt_ids) - 1)
        if self.hidden_tap is not None and seq == 0 and reuse > 0:
            reuse = cache.truncate(reuse - 1)
        return reuse

    def _prefill_by_steps(self, new: int, seq: int) -> bool:
        """Whether `new` prompt tokens run as one decoder step rather than a prefill pass (CUDA, up to a
        step's rows: a replay costs a fraction of the pass's launches). One fixed path per length."""
        return 0 < new <= MAX_STEP_TOKENS and self.decoder.rows_at_once and (self.hidden_tap is None or seq != 0)

    def release_workspace(self) -> None:
        """Under a memory budget, give the prefill's cached transient memory beyond WORKSPACE_SLACK
        back. Without one it is kept: giving it back costs each prefill ~0.1 s (H200, 30B shape)."""
        if not self.options.memory_budget:
            return
        if self.device.type == "cuda":
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            if cached > WORKSPACE_SLACK:
                torch.cuda.empty_cache()

    def step(self, tokens: list[int], *, seq: int = 0) -> torch.Tensor:
        """Run `tokens` at the next positions of sequence `seq`; logits [T, V] (float32), row t predicting
        the token after tokens[t], the same bits whatever T (speculative verification needs it)."""
        return self._step(tokens, seq, head=True)

    def step_hidden(self, tokens: list[int], *, seq: int = 0) -> torch.Tensor:
        """`step` without the head: the final residual stream [T, H] (before the final norm), for the
        hot-vocabulary head; `head_rows` gives the logits `step` would have given, bit for bit."""
        return self._step(tokens, seq, head=False)

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] (float32) of rows `step_hidden` returned, with `step`'s bits."""
        with torch.inference_mode():
            return self.decoder.head_rows(hidden).clone()

    def step_unread(self, token: torch.Tensor, *, seq: int = 0) -> torch.Tensor:
        """`step([t])` for t still on the device (the last logits' argmax), queued while the host reads
        it; the position holds UNREAD until the caller's `name_token`. Logits [1, V]."""
        if token.numel() != 1 or token.device.type != self.device.type:  # "cuda:0" is "cuda"
            raise ValueError("step_unread takes one token id on the model's device")
        if self.hidden_tap is not None and seq == 0:
            raise ValueError("step_unread cannot feed the hidden-state tap (it needs the token on the host)")
        return self._step([UNREAD], seq, head=True, device_tokens=token)

    def name_token(self, position: int, token: int, *, seq: int = 0) -> None:
        """The id of the token `step_unread` ran at `position` of sequence `seq`, once read."""
        cache = self.sequences.open_cache(seq)
        if cache.tokens[position] != UNREAD:
            raise ValueError(f"position {position} of sequence {seq} holds a known token")
        cache.name(position, int(token))

    def _step(self, tokens: list[int], seq: int, *, head: bool,
              device_tokens: torch.Tensor | None = None) -> torch.Tensor:
        cache = self.sequences.open_cache(seq)
        if not tokens:
            raise ValueError("step needs at least one token")
        self.sequences.check_room(len(tokens), cache)
        tap = self.hidden_tap if seq == 0 else None
        rows = []
        with torch.inference_mode():
            self._make_resident()
            for i in range(0, len(tokens), MAX_STEP_TOKENS):
                piece = tokens[i:i + MAX_STEP_TOKENS]
                self._position = cache.length
                with timeline.span("step", position=cache.length, tokens=len(piece)):
                    out = self.decoder.step_rows(piece, list(range(cache.length, cache.length + len(piece))),
                                                 [seq] * len(piece), head=head and tap is None,
                                                 device_tokens=device_tokens).clone()
                    if tap is not None:  # the rows before the head, then the head's bits for them
                        tap(cache.length, out)
                        out = self.decoder.head_rows(out).clone() if head else out
                    rows.append(out)
                cache.append(piece)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def warm_steps(self, rows: int, *, seq: int = 0) -> None:
        """Capture the CUDA graphs of steps of 1..rows rows now, not in the first timed step (they
        write K/V at sequence `seq`'s next positions and record no token)."""
        n = min(rows, MAX_STEP_TOKENS)
        start = self.sequences.open_cache(seq).length if seq else self.caches[0].length
        todo = [T for T in range(1, n + 1) if T not in self._warmed]
        if not (todo and self.decoder.rows_at_once and self.decoder.use_graphs) or start + n > self.max_context:
            return
        t0 = time.perf_counter()
        with torch.inference_mode():
            self._make_resident()
            for T in todo:
                self.decoder.step_rows([0] * T, list(range(start, start + T)), [seq] * T)
                self._warmed.add(T)
            self._sync()
        log.info("captured the steps of %s rows in %.1f s", todo, time.perf_counter() - t0)

    def step_many(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """`step` for several sequences at once: {slot: tokens} -> {slot: logits [T_s, V]}, sharing decoder
        steps (each MoE layer loads its experts once); each gets the bits `step` gives it alone."""
        if not batch:
            raise ValueError("step_many needs at least one sequence")
        for seq, tokens in batch.items():
            if not tokens:
                raise ValueError(f"sequence slot {seq}: step needs at least one token")
            self.sequences.check_room(len(tokens), self.sequences.open_cache(seq))
        rows = [(seq, token) for seq in sorted(batch) for token in batch[seq]]
        out: dict[int, list[torch.Tensor]] = {seq: [] for seq in batch}
        with torch.inference_mode():
            self._make_resident()
            for i in range(0, len(rows), MAX_STEP_TOKENS):
                piece = rows[i:i + MAX_STEP_TOKENS]
                slots, tokens = [s for s, _ in piece], [t for _, t in piece]
                positions, seen = [], {}
                for s in slots:  # a sequence's rows take its next positions in order
                    positions.append(self.caches[s].length + seen.get(s, 0))
                    seen[s] = seen.get(s, 0) + 1
                self._position = positions if len(seen) > 1 else positions[0]
                logits = self.decoder.step_rows(tokens, positions, slots)
                at = 0
                for s, n in seen.items():  # rows are grouped by slot
                    out[s].append(logits[at:at + n].clone())
                    self.caches[s].append(tokens[at:at + n])
                    at += n
        return {seq: parts[0] if len(parts) == 1 else torch.cat(parts) for seq, parts in out.items()}

    def rollback(self, length: int, *, seq: int = 0) -> None:
        """Forget sequence `seq`'s cached tokens from position `length` on (rejected drafts)."""
        cache = self.sequences.open_cache(seq)
        if not 0 <= length <= cache.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {cache.length} tokens")
        kept = cache.tokens[:length]
        if cache.truncate(length) < length:  # a recurrent layer's state was kept further back: recompute
            self.prefill(kept, seq=seq)

    def reset(self, *, seq: int = 0) -> None:
        """Forget sequence `seq`'s tokens and the pool's published prefixes: the next prompt is prefilled
        whole (a prefill's bits depend on how its chunks fall)."""
        self.sequences.open_cache(seq).release()
        self.pool.forget_published()

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise MoestreamError("the prompt is empty")
        vocab = self.args.vocab_size
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise MoestreamError(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})")
        if len(prompt_ids) >= self.max_context:
            raise PromptTooLongError(f"the prompt has {len(prompt_ids)} tokens; the context holds {self.max_context} "
                                     "(prompt plus at least one generated token)")

    # -- generation: a loop over prefill and step (moestream.engine.generation) ----------------
    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 logprobs: int = 0, should_stop: Callable[[], bool] | None = None,
                 stop_at_eos: bool = True, speculative: "SpeculativeOptions | None" = None) -> Generation:
        """Prefill, then the decode loop; with `speculative`, drafts verified: the same tokens, faster."""
        return generation.generate(self, prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling,
                                   logprobs=logprobs, should_stop=should_stop, stop_at_eos=stop_at_eos,
                                   speculative=speculative)

    def emitter(self, prompt_ids: list[int], state: dict, *, sampling: SamplingParams, logprobs: int = 0,
                should_stop: Callable[[], bool] | None = None) -> Emitter:
        """The chooser `generate` uses, for a caller driving the loop's pieces over `step_many` (the
        server's batch scheduler); `state` as in Emitter."""
        return Emitter(list(prompt_ids), state, sampling=sampling, logprobs=logprobs,
                       eos_ids=self.tokenizer.eos_token_ids, should_stop=should_stop, stop_at_eos=True)

    def prompt_logprobs(self, prompt_ids: list[int], k: int, *, seq: int = 0,
                        should_stop: Callable[[], bool] | None = None
                        ) -> list[tuple[int, float | None, list[tuple[int, float]]]] | None:
        """generation.score_prompt of every prompt token (what evaluation harnesses score), or None if
        should_stop interrupted the prefill."""
        logits, _ = self.prefill(list(prompt_ids), seq=seq, should_stop=should_stop, all_logits=True)
        if logits is None:
            return None
        return generation.score_prompt(logits, prompt_ids, k)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- statistics -------------------------------------------------------------
    def expert_stats(self) -> dict:
        stats = dict(self.provider.stats())
        if self.parallel is not None:
            stats.update(collective_s=self.parallel.group.collective_s, exchanges=self.parallel.group.exchanges)
        if self.experts.cpu_share is not None:
            stats.update(self.experts.cpu_share.stats())
        if self.experts.unpacked is not None:
            stats.update(self.experts.unpacked.stats())
        return stats

    def stats(self) -> dict:
        used, total = self.pool.usage()
        return {"model": self.model_name, "family": self.packed.family, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "max_context": self.max_context,
                "experts": self.expert_stats(), "kv": {"blocks_used": used, "blocks_total": total}}

    def memory_ledger(self) -> dict:
        return self.plan.ledger.to_json()


def load_engine(model: str | os.PathLike | None, options: EngineOptions, *, digest_dir: str | None = None,
                reroute: Callable | None = None) -> Engine:
    """The Engine generate, serve and bench load: `model` (None: the demo model), options resolved."""
    packed, default_size = open_packed(model)
    options = resolve_options(packed, options, default_cache_size=default_size, digest_dir=digest_dir)
    return Engine(packed, options, default_cache_size=default_size, digest_dir=digest_dir, reroute=reroute)


def open_packed(model: str | os.PathLike | None) -> tuple[PackedModel, str]:
    """The packed model at `model` (None: the built-in demo model) and its default cache size."""
    if model is None:
        if not (DEMO_MODEL / "moestream.json").is_file():
            raise MoestreamError(f"no --model given and the built-in demo model is missing at {DEMO_MODEL}")
        return PackedModel(DEMO_MODEL), DEMO_CACHE_SIZE
    return PackedModel(Path(model)), "auto"
