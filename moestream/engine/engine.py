"""The engine: a packed model, its expert provider, a KV cache and the generation loop.

One Engine serves one sequence at a time. It keeps the last sequence's KV cache and reuses the
longest common token prefix of the next prompt, so a chat that re-sends its history prefills only
the new part."""
from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Callable, Iterator

import torch

from moestream.engine.kv_cache import KVCache
from moestream.engine.options import EngineOptions
from moestream.engine.sampling import choose_token
from moestream.engine.tokenizer import load_tokenizer
from moestream.engine.types import GenerationResult, SamplingParams, TokenEvent
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from moestream.models.registry import build_model

log = logging.getLogger(__name__)
DEMO_MODEL = Path(__file__).resolve().parent.parent / "demo" / "model"
DEMO_CACHE_SIZE = "30%"  # smaller than the demo model, so its first run really streams experts


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
    def __init__(self, packed: PackedModel, options: EngineOptions, *, default_cache_size: str = "auto"):
        from moestream.engine.plan import plan_run
        from moestream.experts.cache import ExpertCache
        from moestream.experts.sources import open_source

        self.packed, self.options = packed, options
        self.plan = plan_run(packed, options, default_cache_size=default_cache_size)
        self.device, self.dtype, self.max_context = self.plan.device, self.plan.dtype, self.plan.max_context
        if options.threads > 0:
            torch.set_num_threads(options.threads)
        source = open_source(options.expert_source, packed, io_threads=options.io_threads,
                             check_records=options.check_records)
        self.provider = ExpertCache(packed, self.device, slots=self.plan.slots, source=source,
                                    policy=self.plan.cache_policy, partition=options.cache_partition,
                                    host_slots=self.plan.host_slots, host_policy=options.host_cache_policy,
                                    staging_buffers=self.plan.staging)
        self.args, self.model = build_model(packed, self.provider, device=self.device, dtype=self.dtype)
        from moestream.experts.predict import attach

        # CPU for now: on CUDA one-token steps run in the decoder, which does not predict yet
        self.prefetcher = attach(self.model, self.provider, options.prefetch if self.device.type == "cpu" else "none")
        self.tokenizer = load_tokenizer(packed.directory, packed.config)
        self.model_name = packed.directory.name if packed.directory != DEMO_MODEL else "moestream-demo"
        self.cache = KVCache(self.args.num_hidden_layers, self.args.num_key_value_heads, self.args.head_dim,
                             self.max_context, dtype=self.dtype, device=self.device)
        self._cached_tokens: list[int] = []  # tokens whose K/V are in self.cache
        self.decoder = None  # CUDA: one-token steps from static buffers, as CUDA graphs unless turned off
        if self.device.type == "cuda":
            try:
                from moestream.engine import decoder
            except ImportError as exc:  # no Triton
                decoder, why_not = None, str(exc)
            else:
                why_not = decoder.supported(self.model, self.provider)
            if why_not is None:
                self.decoder = decoder.CudaDecoder(self.model, self.cache, self.provider, graphs=options.cuda_graphs)
            else:
                log.info("decode steps without the CUDA decoder: %s", why_not)
        self._resident_checked = False
        self._position = 0  # first position of the chunk being run (for routing traces)
        self.trace = None
        if options.trace_routing:
            self._start_trace()

    def _start_trace(self) -> None:
        from moestream.sim.trace import TraceRecorder

        blocks = [layer.ffn for layer in self.model.layers if hasattr(layer.ffn, "on_route")]
        self.trace = TraceRecorder({"model": self.model_name, "family": self.packed.family,
                                    "num_experts": self.args.num_experts, "top_k": self.args.num_experts_per_tok,
                                    "moe_layers": [b.layer for b in blocks], "num_layers": self.args.num_hidden_layers})
        for block in blocks:
            block.on_route = lambda layer, ids: self.trace.record(layer, self._position, ids.cpu().numpy())

    def save_trace(self) -> None:
        if self.trace is not None:
            self.trace.to_trace().save(self.options.trace_routing)

    def close(self) -> None:
        self.save_trace()
        self.provider.close()

    @classmethod
    def load(cls, model_dir: str | Path | None = None, *, options: EngineOptions | None = None) -> "Engine":
        if model_dir is None:
            model_dir = DEMO_MODEL
            if not (DEMO_MODEL / "moestream.json").is_file():
                raise MoestreamError(f"no --model given and the built-in demo model is missing at {DEMO_MODEL}")
            return cls(PackedModel(model_dir), options or EngineOptions(), default_cache_size=DEMO_CACHE_SIZE)
        return cls(PackedModel(model_dir), options or EngineOptions())

    # -- running the model ----------------------------------------------------
    def _forward(self, ids: list[int], start: int, *, all_logits: bool = False) -> torch.Tensor:
        self._position = start
        with torch.inference_mode():
            self._make_resident()
            if self.decoder is not None and len(ids) == 1:
                return self.decoder.step(ids[0], start)
            t = torch.tensor(ids, dtype=torch.long, device=self.device)
            return self.model.forward(t, start, self.cache, all_logits=all_logits)

    def _make_resident(self) -> None:
        """On CUDA, when the device cache has a slot for every expert, load them all once: then no
        layer needs a cache lookup or a host sync, and a decode step is one CUDA graph."""
        if self._resident_checked:
            return
        self._resident_checked = True
        if self.device.type == "cuda" and self.provider.can_hold_all():
            t0 = time.perf_counter()
            self.provider.make_resident()
            log.info("all %d experts resident on %s (%.1f s)", self.provider.total_experts, self.device,
                     time.perf_counter() - t0)

    def reset(self) -> None:
        """Forget the cached sequence (the next prompt is prefilled whole)."""
        self.cache.truncate(0)
        self._cached_tokens = []

    def prefill(self, prompt_ids: list[int], *, should_stop: Callable[[], bool] | None = None,
                all_logits: bool = False) -> tuple[torch.Tensor | None, int]:
        """Bring the KV cache to `prompt_ids`, reusing the cached prefix; returns (logits of the
        computed positions or the last one, tokens reused). None if should_stop interrupted it."""
        reuse = min(common_prefix(self._cached_tokens, prompt_ids), len(prompt_ids) - 1)
        if all_logits:
            reuse = 0
        self.cache.truncate(reuse)
        self._cached_tokens = self._cached_tokens[:reuse]
        chunk = max(1, self.options.prefill_chunk_tokens)
        outputs = []
        for start in range(reuse, len(prompt_ids), chunk):
            if should_stop is not None and should_stop():
                return None, reuse
            piece = prompt_ids[start:start + chunk]
            outputs.append(self._forward(piece, start, all_logits=all_logits))
            self._cached_tokens.extend(piece)
        return (torch.cat(outputs) if all_logits else outputs[-1]), reuse

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

    def generate(self, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams = SamplingParams(),
                 logprobs: int = 0, should_stop: Callable[[], bool] | None = None,
                 stop_at_eos: bool = True) -> Generation:
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
                for step in range(budget):
                    if should_stop is not None and should_stop():
                        state["finish"] = "cancelled"
                        return
                    row = logits[-1]
                    previous = torch.tensor(seq, device=row.device) if sampling.repetition_penalty != 1.0 else None
                    token = choose_token(row, sampling, position=len(seq), previous=previous)
                    if stop_at_eos and token in self.tokenizer.eos_token_ids:
                        state["finish"] = "stop"
                        return
                    event = TokenEvent(token)
                    if logprobs:
                        lp = torch.log_softmax(row, dim=-1)
                        top = torch.topk(lp, min(logprobs, lp.numel()))
                        event.logprob = float(lp[token])
                        event.top_logprobs = [(int(i), float(v)) for v, i in zip(top.values, top.indices)]
                    seq.append(token)
                    state["tokens"].append(token)
                    yield event
                    if step + 1 < budget:
                        logits = self._forward([token], len(seq) - 1)
                        self._cached_tokens.append(token)
            finally:
                state["decode_s"] = time.perf_counter() - t1

        def finish() -> GenerationResult:
            self.save_trace()
            receipt = self._receipt(len(prompt_ids), state, before)
            return GenerationResult(list(state["tokens"]), state["finish"], receipt)

        return Generation(steps(), finish)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- statistics -------------------------------------------------------------
    def expert_stats(self) -> dict:
        return dict(self.provider.stats())

    def stats(self) -> dict:
        return {"model": self.model_name, "family": self.packed.family, "device": str(self.device),
                "dtype": str(self.dtype).replace("torch.", ""), "max_context": self.max_context,
                "experts": self.expert_stats()}

    def _receipt(self, prompt_tokens: int, state: dict, before: dict) -> dict:
        after = self.expert_stats()
        generated = len(state["tokens"])
        prefilled = prompt_tokens - state["reused"]
        delta = {k: after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses", "bytes_read_disk",
                                                                   "bytes_read_host", "read_wait_s")}
        lookups = delta["hits"] + delta["misses"]
        return {
            "prompt_tokens": prompt_tokens, "prefill_tokens": prefilled, "reused_tokens": state["reused"],
            "generated_tokens": generated, "finish_reason": state["finish"],
            "prefill_s": round(state["prefill_s"], 6), "decode_s": round(state["decode_s"], 6),
            "prefill_tok_s": round(prefilled / state["prefill_s"], 3) if state["prefill_s"] > 0 else None,
            "decode_tok_s": round(generated / state["decode_s"], 3) if state["decode_s"] > 0 and generated else None,
            "hit_rate": round(delta["hits"] / lookups, 6) if lookups else 1.0,
            "misses": delta["misses"], "bytes_read_disk": delta["bytes_read_disk"],
            "bytes_read_host": delta["bytes_read_host"], "read_wait_s": round(delta["read_wait_s"], 6),
            "experts": after, "memory": self.memory_ledger(),
            "device": str(self.device), "model": self.model_name,
        }

    def memory_ledger(self) -> dict:
        resident = sum(t.numel() * t.element_size() for t in _tensors_of(self.model))
        kv = self.cache.keys.numel() * self.cache.keys.element_size() * 2
        return {**self.plan.ledger.to_json(), "resident_weights": resident, "kv_cache": kv}


def _tensors_of(model) -> list[torch.Tensor]:
    """Resident tensors of the stack (attention, norms, routers, shared and dense FFNs), each once."""
    seen, out = set(), []
    objects = [model] + [obj for layer in model.layers
                         for obj in (layer, layer.attn.w, layer.ffn, getattr(layer.ffn, "shared", None)) if obj is not None]
    for obj in objects:
        for t in vars(obj).values():
            if isinstance(t, torch.Tensor) and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out
