"""The engine: a packed model, its expert provider, a KV cache and the generation loop.

An Engine has `max_sequences` sequence slots, each with its own KV cache; slot 0 is the default
sequence that prefill/step/rollback work on. Several slots decode together through `step_many`:
the experts one step routes to are loaded once for all of them, and each sequence gets the bits it
gets alone. A slot keeps its KV cache and reuses the longest common token prefix of the next
prompt, so a chat that re-sends its history prefills only the new part."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from moestream.layers.kv_cache import KVCache
from moestream.engine.emitter import Emitter
from moestream.engine.options import EngineOptions
from moestream.engine.receipt import Receipt
from moestream.engine import timeline
from moestream.engine.tokenizer import load_tokenizer
from moestream.engine.types import GenerationResult, SamplingParams, TokenEvent
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from moestream.models.registry import build_model

if TYPE_CHECKING:
    from moestream.engine.speculative import SpeculativeOptions

log = logging.getLogger(__name__)
DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo" / "model"
DEMO_CACHE_SIZE = "30%"  # smaller than the demo model, so its first run really streams experts
WORKSPACE_SLACK = 256 << 20  # cached-but-free device bytes kept after a prefill


class PromptTooLongError(MoestreamError):
    pass


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Generation:
    """Iterate for TokenEvents; `result` holds the GenerationResult once iteration ends or close() is called."""

    def __init__(self, steps: Iterator[TokenEvent], finish: Callable[[], GenerationResult]):
        self._steps, self._finish = steps, finish
        self.result: GenerationResult | None = None

    def __iter__(self):
        return self

    def __next__(self) -> TokenEvent:
        try:
            return next(self._steps)
        except StopIteration:
            self.result = self._finish()
            raise

    def close(self) -> GenerationResult:
        if self.result is None:
            self._steps.close()
            self.result = self._finish()
        return self.result


class Engine:
    """A packed model ready to run: prefill a prompt, step T tokens, roll the KV cache back.

    `generate` is a small loop over these; speculative decoding and batching build on the same
    pieces. Each sequence slot's KV cache holds its sequence (and is the record of its tokens);
    `cache` is slot 0's."""

    def __init__(self, packed: PackedModel, options: EngineOptions, *, default_cache_size: str = "auto"):
        from moestream.engine.decoder import Decoder
        from moestream.engine.plan import plan_run
        from moestream.experts.cache import ExpertCache
        from moestream.experts.predict import Lookahead, attach
        from moestream.experts.sources import open_source
        from moestream.layers.experts import RoutedExperts

        self.packed, self.options = packed, options
        self.plan = plan_run(packed, options, default_cache_size=default_cache_size)
        self.device, self.dtype, self.max_context = self.plan.device, self.plan.dtype, self.plan.max_context
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        self.parallel = self._expert_parallel(packed, options)
        slots = self.plan.slots
        if self.parallel is not None:  # a rank never needs more slots than the experts it owns
            slots = max(1, min(slots, self.parallel.placement.count(self.parallel.group.rank)))
        source = open_source(options.expert_source, packed, io_threads=options.io_threads,
                             check_records=options.verify)
        self.provider = ExpertCache(packed, self.device, slots=slots, source=source,
                                    policy=self.plan.cache_policy, partition=options.cache_partition,
                                    host_slots=self.plan.host_slots, host_policy=options.host_cache_policy,
                                    staging_buffers=self.plan.staging)
        if self.parallel is not None:
            from moestream.layers.expert_parallel import OwnedExperts

            self.provider = OwnedExperts(self.provider, self.parallel.placement, self.parallel.group.rank)
        try:
            def make_experts(args):  # the decoder's MoE layers and the multi-token-prediction layers' experts
                layers = args.moe_layers() + args.mtp_expert_layers(packed.manifest.mtp_layers)
                moe = {i: args.num_experts for i in layers}
                return RoutedExperts(self.provider, moe, device=self.device, kernels=options.expert_kernels,
                                     parallel=self.parallel)

            self.args, self.experts, self.model = build_model(packed, make_experts, device=self.device,
                                                              dtype=self.dtype)
            # CPU: a hook after each layer's fetch; CUDA: the decoder guesses on the device (Lookahead)
            cpu = self.device.type == "cpu"
            self.guess_maps = self._load_guess_maps(packed, options) if options.prefetch != "none" else None
            self.prefetcher = attach(self.model, self.experts, self.provider, options.prefetch if cpu else "none",
                                     maps=self.guess_maps)
            lookahead = None if cpu or options.prefetch == "none" else \
                Lookahead(self.provider, depth=2 if options.prefetch == "two-layers" else 1)
            self.tokenizer = load_tokenizer(packed.directory, packed.config)
            self._share_with_cpu(options)
        except BaseException:
            self.provider.close()
            raise
        self.model_name = packed.directory.name if packed.directory != DEMO_MODEL else "moestream-demo"
        # every slot's cache exists from the start: CUDA graphs bind to it, and the ledger counts it
        self.caches = [KVCache.for_layout(self.args.kv_layout(), self.max_context, dtype=self.dtype, device=self.device)
                       for _ in range(options.max_sequences)]
        self._open = {0}  # slot 0, the default sequence, is open from the start
        self.decoder = Decoder(self.model, self.caches, self.experts, graphs=options.cuda_graphs, lookahead=lookahead,
                               maps=self.guess_maps)
        self._resident_checked = False
        # sees the final residual stream (before the final norm) of every position slot 0 computes:
        # hidden_tap(first position, rows [T, H]); the MTP drafter's input (moestream.engine.mtp_drafter)
        self.hidden_tap: Callable[[int, torch.Tensor], None] | None = None
        self._position = 0  # first position of the chunk being run (for routing traces)
        self.trace = None
        if options.trace_routing:
            self._start_trace()

    def _load_guess_maps(self, packed: PackedModel, options: EngineOptions):
        """The lookahead's fitted corrections (moestream fit-lookahead) on the device, or None."""
        from moestream.experts.guess_maps import GuessMaps, manifest_digest, maps_path
        from moestream.layers.moe import MoEBlock

        path = maps_path(packed.directory, options.lookahead_maps)
        if path is None:
            return None
        if not path.is_file():
            raise MoestreamError(f"lookahead maps {path}: no such file")
        try:
            maps = GuessMaps.load(path)
            maps.check([layer.ffn for layer in self.model.layers if isinstance(layer.ffn, MoEBlock)],
                       self.args.hidden_size)
        except ValueError as exc:
            raise MoestreamError(str(exc)) from None
        fitted_for = maps.meta.get("model_manifest_sha256")
        if fitted_for is not None and fitted_for != manifest_digest(packed.directory):
            raise MoestreamError(f"lookahead maps {path} were fitted for another model (its moestream.json differs)")
        log.info("lookahead maps: %s (%d maps, %d bytes)", path, len(maps.maps), maps.nbytes)
        return maps.to(self.device)

    @property
    def lookahead(self):
        """The Lookahead scoring this engine's guesses (the device-driven path's, the decoder's on CUDA,
        the prefetcher's on the CPU), or None."""
        if self.experts.device_lookahead is not None:
            return self.experts.device_lookahead
        if self.decoder.lookahead is not None:
            return self.decoder.lookahead
        return self.prefetcher.lookahead if self.prefetcher is not None else None

    def _share_with_cpu(self, options: EngineOptions) -> None:
        """--cpu-experts: the CPU computes a share of each streamed layer's misses from host RAM,
        on a worker with the compute threads (--threads). Its weights are repacked before the first
        step (`_prepare_cpu_share`)."""
        from moestream.layers.cpu_share import parse_share

        try:
            share = parse_share(options.cpu_experts)
        except ValueError as exc:
            raise MoestreamError(f"cpu_experts: {exc}") from None
        if share == "off":
            return
        if self.parallel is not None:
            raise MoestreamError("--cpu-experts does not run with expert parallelism (--devices)")
        if not options.cpu_experts_timeout > 0:
            raise MoestreamError(f"cpu_experts_timeout must be more than 0 seconds, not {options.cpu_experts_timeout}")
        self.experts.share_with_cpu(share, dtype=self.dtype, timeout_s=options.cpu_experts_timeout,
                                    threads=options.threads)

    def _prepare_cpu_share(self) -> None:
        """Before the first streamed step with a CPU share: fill the host tier (the records it lacks)
        and repack every record of it the CPU kernels take, once, so that a step never repacks."""
        if self.provider.host is None:
            log.warning("--cpu-experts: there is no host tier (--host-cache-size), so the CPU has no "
                        "repacked experts to compute")
            return
        t0 = time.perf_counter()
        read = self.provider.fill_host_tier()
        if read:
            log.info("read %d records into the host tier for the CPU share (%.1f s)", read, time.perf_counter() - t0)
        self.experts.cpu.repack_host_tier(self.provider.host_records())

    @staticmethod
    def _expert_parallel(packed: PackedModel, options: EngineOptions):
        """The ExpertParallel of this rank (group and placement), or None for one process."""
        group = options.expert_parallel
        if group is None or group.world_size <= 1:
            return None
        from moestream.layers.expert_parallel import ExpertParallel, ExpertPlacement

        counts = {e.layer: e.num_experts for e in packed.manifest.expert_layers}
        if options.expert_placement:
            placement = ExpertPlacement.from_trace(options.expert_placement, counts, group.world_size)
        else:
            placement = ExpertPlacement.modulo(counts, group.world_size)
        log.info("rank %d of %d: %d experts (%s placement)", group.rank, group.world_size,
                 placement.count(group.rank), placement.source)
        return ExpertParallel(group, placement)

    def parallel_stats(self, before: dict, after: dict) -> dict | None:
        """Every rank's expert-cache figures for a run (from its stats before and after), gathered
        from all ranks (a collective: every rank calls it at the same point). None for one process."""
        if self.parallel is None:
            return None
        group = self.parallel.group
        hits, misses = (after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses"))
        mine = {"rank": group.rank, "experts_owned": self.parallel.placement.count(group.rank),
                "hit_rate": round(hits / (hits + misses), 6) if hits + misses else 1.0, "hits": hits,
                "misses": misses,
                **{k: after.get(k, 0) - before.get(k, 0) for k in ("bytes_read_disk", "bytes_read_host")},
                "read_wait_s": round(after.get("read_wait_s", 0.0) - before.get("read_wait_s", 0.0), 6),
                "collective_s": round(after.get("collective_s", 0.0) - before.get("collective_s", 0.0), 6),
                "exchanges": after.get("exchanges", 0) - before.get("exchanges", 0)}
        return {"world_size": group.world_size, "placement": self.parallel.placement.source,
                "ranks": group.all_gather_object(mine)}

    def _start_trace(self) -> None:
        from moestream.sim.trace import TraceRecorder

        moe_layers = self.args.moe_layers()
        self.trace = TraceRecorder({"model": self.model_name, "family": self.packed.family,
                                    "num_experts": self.args.num_experts, "top_k": self.args.num_experts_per_tok,
                                    "moe_layers": moe_layers, "num_layers": self.args.num_hidden_layers})
        self.experts.on_route = lambda layer, ids: self.trace.record(layer, self._position, ids.cpu().numpy())

    @property
    def cache(self) -> KVCache:
        """Slot 0's KV cache (the default sequence)."""
        return self.caches[0]

    def save_trace(self) -> None:
        if self.trace is not None:
            self.trace.to_trace().save(self.options.trace_routing)

    def close(self) -> None:
        self.save_trace()
        if self.experts.device_share is not None:
            self.experts.device_share.close()
        if self.experts.cpu is not None:
            self.experts.cpu.close()
        self.provider.close()

    @classmethod
    def load(cls, model_dir: str | Path | None = None, *, options: EngineOptions | None = None) -> "Engine":
        if model_dir is None:
            model_dir = DEMO_MODEL
            if not (DEMO_MODEL / "moestream.json").is_file():
                raise MoestreamError(f"no --model given and the built-in demo model is missing at {DEMO_MODEL}")
            return cls(PackedModel(model_dir), options or EngineOptions(), default_cache_size=DEMO_CACHE_SIZE)
        return cls(PackedModel(model_dir), options or EngineOptions())

    # -- running the model: prefill, step, rollback -----------------------------------------
    def _make_resident(self) -> None:
        """On CUDA, when the device cache has a slot for every expert, load them all once: then no
        layer needs a cache lookup or a host sync, and a decode step is one CUDA graph."""
        if self._resident_checked:
            return
        self._resident_checked = True
        if self.device.type == "cuda" and self.provider.can_hold_all():
            t0 = time.perf_counter()
            self.experts.make_resident()
            log.info("all %d experts resident on %s (%.1f s)", self.provider.total_experts, self.device,
                     time.perf_counter() - t0)
            return
        self._start_streaming()

    @property
    def streaming(self) -> str:
        """How routed experts reach the device: resident, device (the device map) or host. Decided at
        the first prefill or step (`_make_resident`); before it, host."""
        return "resident" if self.experts.resident else "device" if self.experts.device_map is not None else "host"

    def _start_streaming(self) -> None:
        """Device-driven streaming where the option allows and it can run (else the host path);
        `--streaming device` where it cannot is an error naming why."""
        from moestream.experts.device_map import DeviceMapUnavailable

        if self.experts.cpu is not None:
            self._prepare_cpu_share()
        mode = self.options.streaming
        if mode == "host":
            return
        reason = None
        if self.parallel is not None:
            reason = "expert parallelism computes experts on several ranks"
        elif mode == "auto" and self.options.cpu_experts != "off":
            # the device path's CPU share (a mailbox the step's graph waits on) has not been timed on a
            # GPU yet: `--streaming device` asks for it
            reason = "a CPU share runs on the host path unless --streaming device asks for the device path's"
        elif mode == "auto" and self.device.type != "cuda":
            reason = "on the CPU the host drives"
        elif mode == "auto" and not all(self.experts.uses_triton(layer, self.dtype) for layer in self.experts.num_experts):
            reason = "some layers' experts run on the torch reference, which reads slots on the host"
        elif mode == "auto" and self.plan.host_slots < self.provider.total_experts:
            reason = "the host tier does not hold every expert (--host-cache-size all)"
        if reason is None:
            t0 = time.perf_counter()
            try:
                self.experts.start_device_map()
                self.experts.device_map.kernel = self.options.slot_map == "triton"
                if self.experts.cpu is not None:  # the CPU's share through a mailbox, inside the graphs
                    self.experts.share_on_device(hidden=self.args.hidden_size, dtype=self.dtype, max_tokens=16,
                                                 timeout_s=self.options.cpu_experts_timeout)
                elif self.options.device_lookahead and self.options.prefetch != "none":
                    self.decoder.start_device_lookahead(2 if self.options.prefetch == "two-layers" else 1)
                log.info("device-driven streaming: %d slots, the host tier holds all %d experts (%.1f s)",
                         self.plan.slots, self.provider.total_experts, time.perf_counter() - t0)
                return
            except DeviceMapUnavailable as exc:
                reason = str(exc)
        if mode == "device":
            raise MoestreamError(f"--streaming device cannot run: {reason}")
        log.info("host-driven streaming: %s", reason)

    def _check_room(self, n: int, cache: KVCache | None = None) -> None:
        cache = self.cache if cache is None else cache
        if cache.length + n > self.max_context:
            raise PromptTooLongError(f"{cache.length + n} tokens exceed the context of {self.max_context}")

    # -- sequence slots ------------------------------------------------------------------------
    def _slot(self, seq: int) -> KVCache:
        """The KV cache of open slot `seq`, or a clear error."""
        if not isinstance(seq, int) or not 0 <= seq < len(self.caches):
            raise ValueError(f"sequence slot {seq!r} does not exist (slots 0..{len(self.caches) - 1})")
        if seq not in self._open:
            raise ValueError(f"sequence slot {seq} is not open (open_sequence() opens one)")
        return self.caches[seq]

    @property
    def open_sequences(self) -> list[int]:
        return sorted(self._open)

    def open_sequence(self, prefix: list[int] | None = None, *, slot: int | None = None) -> int:
        """Open a free slot and return its id. With `prefix` (the prompt to come), the free slot
        whose cache shares the longest start with it, that start kept (prefill reuses it); else
        the lowest free slot, emptied. `slot` names the free slot to open (a caller's own choice,
        e.g. the least recently used); its shared start with `prefix` is kept the same way."""
        free = [s for s in range(len(self.caches)) if s not in self._open]
        if not free:
            raise MoestreamError(f"all {len(self.caches)} sequence slots are open (max_sequences)")
        if slot is not None and slot not in free:
            raise ValueError(f"sequence slot {slot!r} is not a free slot (free: {free})")
        shared = {s: common_prefix(self.caches[s].tokens, prefix) if prefix else 0 for s in free}
        if slot is None:
            slot = max(free, key=lambda s: (shared[s], -s))
        self.caches[slot].truncate(shared[slot])
        self._open.add(slot)
        return slot

    def close_sequence(self, seq: int) -> None:
        """Free slot `seq` for open_sequence (its cached tokens stay, for a later prompt's prefix)."""
        self._slot(seq)
        self._open.discard(seq)

    def prefill(self, prompt_ids: list[int], *, seq: int = 0, should_stop: Callable[[], bool] | None = None,
                all_logits: bool = False) -> tuple[torch.Tensor | None, int]:
        """Bring sequence `seq`'s KV cache to `prompt_ids`, reusing the cached prefix, in chunks of
        `prefill_chunk_tokens`; returns (logits [T, V] of the computed positions with all_logits, else
        of the last one [1, V]; tokens reused). (None, reused) if should_stop interrupted it."""
        cache = self._slot(seq)
        reuse = 0 if all_logits else min(common_prefix(cache.tokens, prompt_ids), len(prompt_ids) - 1)
        if self.hidden_tap is not None and seq == 0:  # the tap sees the state before the first new token too
            reuse = max(0, reuse - 1)
        reuse = cache.truncate(reuse)  # less where a recurrent layer keeps no state at `reuse`
        self._check_room(len(prompt_ids) - reuse, cache)
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
                    ids = torch.tensor(piece, dtype=torch.long, device=self.device)
                    with timeline.span("prefill_chunk", position=start, tokens=len(piece)):
                        outputs.append(self.model.forward(ids, start, cache, all_logits=all_logits))
                    cache.append(piece)
        finally:
            self.model.on_hidden = None
        self.release_workspace()
        return (torch.cat(outputs) if all_logits else outputs[-1]), reuse

    def release_workspace(self) -> None:
        """Give the prefill's transient memory back to the device (decode needs a small part of it),
        where the allocator keeps more than WORKSPACE_SLACK of it cached."""
        if self.device.type == "cuda":
            cached = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            if cached > WORKSPACE_SLACK:
                torch.cuda.empty_cache()

    def step(self, tokens: list[int], *, seq: int = 0) -> torch.Tensor:
        """Run `tokens` at the next positions of sequence `seq`; logits [T, V] (float32), row t
        predicting the token after tokens[t]. A token's logits are the same bits whatever T is:
        step([a, b]) gives what step([a]) then step([b]) give (speculative verification needs it)."""
        return self._step(tokens, seq, head=True)

    def step_hidden(self, tokens: list[int], *, seq: int = 0) -> torch.Tensor:
        """`step` without the head: the final residual stream [T, H] (before the final norm), for
        a caller that scores rows its own way (the hot-vocabulary head); `head_rows` gives the
        logits `step` would have given those rows, bit for bit."""
        return self._step(tokens, seq, head=False)

    def head_rows(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [n, V] (float32) of rows that `step_hidden` returned, with `step`'s bits: on CUDA
        one pass over the weights for all of them (n <= decoder.MAX_STEP_TOKENS)."""
        with torch.inference_mode():
            return self.decoder.head_rows(hidden).clone()

    def _step(self, tokens: list[int], seq: int, *, head: bool) -> torch.Tensor:
        from moestream.engine.decoder import MAX_STEP_TOKENS

        cache = self._slot(seq)
        if not tokens:
            raise ValueError("step needs at least one token")
        self._check_room(len(tokens), cache)
        tap = self.hidden_tap if seq == 0 else None
        rows = []
        with torch.inference_mode():
            self._make_resident()
            for i in range(0, len(tokens), MAX_STEP_TOKENS):
                piece = tokens[i:i + MAX_STEP_TOKENS]
                self._position = cache.length
                with timeline.span("step", position=cache.length, tokens=len(piece)):
                    out = self.decoder.step(piece, cache.length, slot=seq, head=head and tap is None).clone()
                    if tap is not None:  # the rows before the head, then the head's bits for them
                        tap(cache.length, out)
                        out = self.decoder.head_rows(out).clone() if head else out
                    rows.append(out)
                cache.append(piece)
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def step_many(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        """`step` for several sequences at once: {slot: tokens} -> {slot: logits [T_s, V]}. Their
        rows share decoder steps, so each MoE layer loads the union of the experts they route to
        once; each sequence's logits are the bits `step` gives it alone."""
        from moestream.engine.decoder import MAX_STEP_TOKENS

        if not batch:
            raise ValueError("step_many needs at least one sequence")
        for seq, tokens in batch.items():
            if not tokens:
                raise ValueError(f"sequence slot {seq}: step needs at least one token")
            self._check_room(len(tokens), self._slot(seq))
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
        """Forget sequence `seq`'s cached tokens from position `length` on (rejected draft tokens,
        a new prompt)."""
        cache = self._slot(seq)
        if not 0 <= length <= cache.length:
            raise ValueError(f"cannot roll back to {length}: the cache holds {cache.length} tokens")
        kept = cache.tokens[:length]
        if cache.truncate(length) < length:  # a recurrent layer's state was kept further back: recompute
            self.prefill(kept, seq=seq)

    def reset(self, *, seq: int = 0) -> None:
        """Forget sequence `seq`'s cached tokens (the next prompt is prefilled whole)."""
        self._slot(seq).truncate(0)

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

    # -- generation: a loop over prefill and step ----------------------------------------------
    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 logprobs: int = 0, should_stop: Callable[[], bool] | None = None,
                 stop_at_eos: bool = True, speculative: "SpeculativeOptions | None" = None) -> Generation:
        """With `speculative`, the decode loop of moestream.engine.speculative: the same tokens, faster."""
        self.check_prompt(prompt_ids)
        state: dict = {"tokens": [], "finish": "length", "prefill_s": 0.0, "decode_s": 0.0, "reused": 0}
        before = self.expert_stats()

        def steps() -> Iterator[TokenEvent]:
            t0 = time.perf_counter()
            logits, state["reused"] = self.prefill(prompt_ids, should_stop=should_stop)
            self._sync()
            state["prefill_s"] = time.perf_counter() - t0
            if logits is None:
                state["finish"] = "cancelled"
                return
            seq = list(prompt_ids)
            budget = min(max_new_tokens, self.max_context - len(prompt_ids))
            t1 = time.perf_counter()
            try:
                if speculative is not None:
                    from moestream.engine import speculative as spec

                    yield from spec.run(self, seq, logits, budget=budget, sampling=sampling, logprobs=logprobs,
                                        should_stop=should_stop, stop_at_eos=stop_at_eos, options=speculative,
                                        state=state)
                    return
                emit = Emitter(seq, state, sampling=sampling, logprobs=logprobs, eos_ids=self.tokenizer.eos_token_ids,
                               should_stop=should_stop, stop_at_eos=stop_at_eos)
                for n in range(budget):
                    event = emit(logits[-1])
                    if event is None:
                        return
                    yield event
                    if n + 1 < budget:
                        logits = self.step([event.token_id])
            finally:
                state["decode_s"] = time.perf_counter() - t1

        def finish() -> GenerationResult:
            self.save_trace()
            after = self.expert_stats()
            receipt = Receipt.of_run(prompt_tokens=len(prompt_ids), reused=state["reused"],
                                     generated=len(state["tokens"]), finish=state["finish"],
                                     prefill_s=state["prefill_s"], decode_s=state["decode_s"], before=before,
                                     after=after, memory=self.memory_ledger(),
                                     parallel=self.parallel_stats(before, after),
                                     device=str(self.device), model=self.model_name,
                                     threads=torch.get_num_threads(), verify=self.options.verify,
                                     lookahead=self.lookahead.stats() if self.lookahead else {},
                                     speculative=state["speculative"].to_json() if "speculative" in state else None)
            return GenerationResult(list(state["tokens"]), state["finish"], receipt)

        return Generation(steps(), finish)

    def emitter(self, prompt_ids: list[int], state: dict, *, sampling: SamplingParams, logprobs: int = 0,
                should_stop: Callable[[], bool] | None = None) -> Emitter:
        """The chooser `generate` uses (one position at a time, from a logits row), for a caller that
        runs its own decode loop over `step_many` (the server's batch scheduler). `state` as in
        Emitter: "tokens" (appended to), "finish" (set when it stops)."""
        return Emitter(list(prompt_ids), state, sampling=sampling, logprobs=logprobs,
                       eos_ids=self.tokenizer.eos_token_ids, should_stop=should_stop, stop_at_eos=True)

    def prompt_logprobs(self, prompt_ids: list[int], k: int, *, seq: int = 0,
                        should_stop: Callable[[], bool] | None = None
                        ) -> list[tuple[int, float | None, list[tuple[int, float]]]] | None:
        """[(token id, its logprob given the tokens before it, the k most likely there)] for every
        prompt token (what evaluation harnesses score); the first has no logprob (None) and no
        alternatives. None if should_stop interrupted the prefill."""
        logits, _ = self.prefill(list(prompt_ids), seq=seq, should_stop=should_stop, all_logits=True)
        if logits is None:
            return None
        logp = torch.log_softmax(logits.float(), dim=-1)  # [T, V]: row i predicts token i + 1
        out: list = [(int(prompt_ids[0]), None, [])]
        if len(prompt_ids) > 1:
            targets = torch.tensor(prompt_ids[1:], dtype=torch.long, device=logp.device)
            chosen = logp[:-1].gather(1, targets[:, None])[:, 0].tolist()
            tops = torch.topk(logp[:-1], min(k, logp.shape[-1])) if k else None
            for i, token in enumerate(prompt_ids[1:]):
                top = [] if tops is None else list(zip(tops.indices[i].tolist(), tops.values[i].tolist()))
                out.append((int(token), float(chosen[i]), top))
        return out

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- statistics -------------------------------------------------------------
    def expert_stats(self) -> dict:
        stats = dict(self.provider.stats())
        if self.parallel is not None:
            stats.update(collective_s=self.parallel.group.collective_s, exchanges=self.parallel.group.exchanges)
        if self.experts.device_share is not None:
            stats.update(self.experts.device_share.stats())
        elif self.experts.cpu is not None:
            stats.update(self.experts.cpu.stats())
        return stats

    def stats(self) -> dict:
        return {"model": self.model_name, "family": self.packed.family, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "max_context": self.max_context,
                "experts": self.expert_stats()}

    def memory_ledger(self) -> dict:
        return self.plan.ledger.to_json()
