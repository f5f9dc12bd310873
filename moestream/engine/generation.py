"""`Engine.generate` (the prefill, the decode loop, the receipt) and `Engine.prompt_logprobs`'s scoring,
over the engine's pieces (this module never imports the engine)."""
from __future__ import annotations

import time
from typing import Callable, Iterator

import torch

from moestream.engine.decode_loop import decode
from moestream.engine.emitter import Emitter
from moestream.engine.expert_setup import parallel_stats
from moestream.engine.receipt import Receipt
from moestream.engine.speculative import SpeculativeOptions
from moestream.engine.types import GenerationResult, SamplingParams, TokenEvent


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


def generate(engine, prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams,
             logprobs: int, should_stop: Callable[[], bool] | None, stop_at_eos: bool,
             speculative: SpeculativeOptions | None) -> Generation:
    """Prefill, then one step a token until the budget, a stop or an end-of-sequence token; the
    receipt is made when the Generation finishes. See Engine.generate."""
    engine.check_prompt(prompt_ids)
    state: dict = {"tokens": [], "finish": "length", "prefill_s": 0.0, "decode_s": 0.0, "reused": 0}
    before = engine.expert_stats()

    def steps() -> Iterator[TokenEvent]:
        t0 = time.perf_counter()
        logits, state["reused"] = engine.prefill(prompt_ids, should_stop=should_stop)
        engine._sync()
        state["prefill_s"] = time.perf_counter() - t0
        if logits is None:
            state["finish"] = "cancelled"
            return
        budget = min(max_new_tokens, engine.max_context - len(prompt_ids))
        t1 = time.perf_counter()
        try:
            speculation = None
            if speculative is not None:
                speculation = speculative.for_generation()
                state["speculative"] = speculation.stats
                speculation.begin(engine, sampling)
            emit = Emitter(list(prompt_ids), state, sampling=sampling, logprobs=logprobs,
                           eos_ids=engine.tokenizer.eos_token_ids, should_stop=should_stop, stop_at_eos=stop_at_eos)
            yield from decode(engine, emit, logits, budget, speculation=speculation)
        finally:
            state["decode_s"] = time.perf_counter() - t1

    def finish() -> GenerationResult:
        engine.save_trace()
        after = engine.expert_stats()
        receipt = Receipt.of_run(prompt_tokens=len(prompt_ids), reused=state["reused"],
                                 generated=len(state["tokens"]), finish=state["finish"],
                                 prefill_s=state["prefill_s"], decode_s=state["decode_s"], before=before,
                                 after=after, memory=engine.memory_ledger(),
                                 parallel=parallel_stats(engine.parallel, before, after),
                                 device=str(engine.device), model=engine.model_name,
                                 threads=torch.get_num_threads(), verify=engine.options.verify,
                                 lookahead=engine.lookahead.stats() if engine.lookahead else {},
                                 speculative=state["speculative"].to_json() if "speculative" in state else None)
        return GenerationResult(list(state["tokens"]), state["finish"], receipt)

    return Generation(steps(), finish)


def score_prompt(logits: torch.Tensor, prompt_ids: list[int], k: int
                 ) -> list[tuple[int, float | None, list[tuple[int, float]]]]:
    """Engine.prompt_logprobs from the prefill's logits [T, V] of every prompt position: each
    token's logprob given the tokens before it and the k most likely there (none for the first)."""
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
