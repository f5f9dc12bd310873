"""Generation over an Engine: the decode loop behind `Engine.generate`, its result, and the
scoring of a prompt's own tokens behind `Engine.prompt_logprobs`.

Kept apart from the engine because it only calls the engine's pieces (prefill, step, the expert
figures), as the speculative and hot-head loops do; the engine holds what runs the model."""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable, Iterator

import torch

from moestream.engine.emitter import Emitter
from moestream.engine.receipt import Receipt
from moestream.engine.types import GenerationResult, SamplingParams, TokenEvent

if TYPE_CHECKING:
    from moestream.engine.engine import Engine
    from moestream.engine.speculative import SpeculativeOptions


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


def generate(engine: "Engine", prompt_ids: list[int], *, max_new_tokens: int, sampling: SamplingParams,
             logprobs: int, should_stop: Callable[[], bool] | None, stop_at_eos: bool,
             speculative: "SpeculativeOptions | None") -> Generation:
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
        seq = list(prompt_ids)
        budget = min(max_new_tokens, engine.max_context - len(prompt_ids))
        t1 = time.perf_counter()
        try:
            if speculative is not None:
                from moestream.engine import speculative as spec

                yield from spec.run(engine, seq, logits, budget=budget, sampling=sampling, logprobs=logprobs,
                                    should_stop=should_stop, stop_at_eos=stop_at_eos, options=speculative,
                                    state=state)
                return
            emit = Emitter(seq, state, sampling=sampling, logprobs=logprobs, eos_ids=engine.tokenizer.eos_token_ids,
                           should_stop=should_stop, stop_at_eos=stop_at_eos)
            yield from plain_tokens(engine, emit, logits, budget)
        finally:
            state["decode_s"] = time.perf_counter() - t1

    def finish() -> GenerationResult:
        engine.save_trace()
        after = engine.expert_stats()
        receipt = Receipt.of_run(prompt_tokens=len(prompt_ids), reused=state["reused"],
                                 generated=len(state["tokens"]), finish=state["finish"],
                                 prefill_s=state["prefill_s"], decode_s=state["decode_s"], before=before,
                                 after=after, memory=engine.memory_ledger(),
                                 parallel=engine.parallel_stats(before, after),
                                 device=str(engine.device), model=engine.model_name,
                                 threads=torch.get_num_threads(), verify=engine.options.verify,
                                 lookahead=engine.lookahead.stats() if engine.lookahead else {},
                                 speculative=state["speculative"].to_json() if "speculative" in state else None)
        return GenerationResult(list(state["tokens"]), state["finish"], receipt)

    return Generation(steps(), finish)


def plain_tokens(engine: "Engine", emit: Emitter, logits: torch.Tensor, budget: int) -> Iterator[TokenEvent]:
    """Plain decoding of up to `budget` tokens, the first chosen from `logits`' last row: decoding
    ahead where it may, else one step a token. The cache then holds every token emitted but the last
    (after a stop while decoding ahead, the last too)."""
    if decodes_ahead(engine, emit):
        yield from _decode_ahead(engine, emit, logits, budget)
        return
    for n in range(budget):
        event = emit(logits[-1])
        if event is None:
            return
        yield event
        if n + 1 < budget:
            logits = engine.step([event.token_id])


def decodes_ahead(engine: "Engine", emit: Emitter) -> bool:
    """Whether plain decoding queues each step before reading the token it takes (`--decode-ahead`):
    greedy choices of the raw logits with no log-probabilities (the choice is an argmax on the
    device), on CUDA unless forced on, and no hidden-state tap (which reads each token on the host)."""
    mode = engine.options.decode_ahead
    return (mode == "on" or (mode == "auto" and engine.device.type == "cuda")) and emit.plain_argmax \
        and not emit.logprobs and engine.hidden_tap is None


def _decode_ahead(engine: "Engine", emit: Emitter, logits: torch.Tensor, budget: int) -> Iterator[TokenEvent]:
    """Greedy decoding that keeps the device busy: step n + 1 is queued with token n still on the
    device (its argmax), then the host reads token n while the step runs, names it in the cache,
    and checks the stops. The same tokens as one step at a time (the same steps, fed the same ids);
    a stop leaves one step more in the cache, the KV of a real token at its position, which the next
    prompt reuses or truncates like any other."""
    reader = _TokenReader(engine.device)
    token = torch.argmax(logits[-1:], dim=-1)  # [1] on the device: argmax_index's choice
    for n in range(budget):
        row = logits[-1]  # the row token n was chosen from
        reader.queue(token)
        ahead = n + 1 < budget
        if ahead:
            position = len(emit.seq)
            logits = engine.step_unread(token)
            token = torch.argmax(logits[-1:], dim=-1)
        try:
            chosen = reader.read()
        except BaseException:  # an interrupt or a device error: no position stays unread
            if ahead:
                engine.rollback(position)
            raise
        if ahead:
            engine.name_token(position, chosen)
        event = emit(row, chosen=chosen)
        if event is None:
            return
        yield event


class _TokenReader:
    """One token id from the device to the host without waiting for work queued after it: a copy
    into pinned memory and an event recorded right behind it (on the CPU, a plain read)."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.host = torch.zeros(1, dtype=torch.long, pin_memory=self.cuda)
        self.done = torch.cuda.Event() if self.cuda else None
        self._token: torch.Tensor | None = None

    def queue(self, token: torch.Tensor) -> None:
        if self.cuda:  # the copy runs on the token's device's stream: the event follows it there
            self.host.copy_(token.reshape(1), non_blocking=True)
            self.done.record(torch.cuda.current_stream(token.device))
        else:
            self._token = token

    def read(self) -> int:
        if self.cuda:
            self.done.synchronize()
            return int(self.host[0])
        return int(self._token.reshape(1)[0])


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
