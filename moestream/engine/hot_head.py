"""The hot-vocabulary head: greedy decoding that scores only a list of common tokens, made exact by
verification.

Each step scores the final hidden state against the rows of the head for a short list of tokens
(the prompt's most frequent tokens and the tokenizer's first ids, which byte-pair merges order
roughly by frequency) and feeds the best of them to the next step as a guess. Every
`verify_every` steps the full head runs over the saved hidden rows; the output takes the full
head's token at each position, and from the first wrong guess on the later steps are discarded
(the KV cache rolled back) and redone. So the tokens are exactly plain greedy decoding's; the list
changes only how often a guess must be redone.

The guess steps stop before the head (`Engine.step_hidden`), and the verification computes the
full head of the saved rows with the bits a plain step gives them (`Engine.head_rows`). What it
saves is the full head's weight read on all but one of each `verify_every` steps, where the
verification reads the weights once for all its rows: on CUDA (a fixed-shape product). On the CPU
the full head still runs once per token (a product's cost grows with its rows there), so the hot
rows are extra work: there it is exact, not faster (docs/PERFORMANCE.md)."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Sequence

import torch
import torch.nn.functional as F

from moestream.engine.emitter import Emitter
from moestream.engine.types import SamplingParams, TokenEvent
from moestream.errors import MoestreamError
from moestream.layers.norm import rms_norm


@dataclass(frozen=True)
class HotHeadOptions:
    prompt_tokens: int = 256  # the prompt's most frequent tokens in the list
    base_tokens: int = 4096  # and the tokenizer's first ids
    verify_every: int = 4  # guesses between full-head passes

    def __post_init__(self):
        if self.verify_every < 1:
            raise MoestreamError(f"the hot head verifies every >= 1 steps, not {self.verify_every}")
        if self.prompt_tokens < 0 or self.base_tokens < 0 or self.prompt_tokens + self.base_tokens == 0:
            raise MoestreamError("the hot-vocabulary list needs prompt or base tokens")


def hot_vocabulary(prompt_ids: Sequence[int], vocab_size: int, *, prompt_tokens: int = 256,
                   base_tokens: int = 4096) -> torch.Tensor:
    """Sorted unique token ids [N]: the prompt's `prompt_tokens` most frequent and ids 0..base_tokens-1."""
    frequent = [t for t, _ in Counter(int(t) for t in prompt_ids).most_common(prompt_tokens)]
    ids = set(range(min(base_tokens, vocab_size))) | {t for t in frequent if 0 <= t < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


class HotHead:
    """The head restricted to `hot_ids`: guesses from final hidden rows (before the final norm)."""

    def __init__(self, final_norm: torch.Tensor, lm_head: torch.Tensor, eps: float, hot_ids: torch.Tensor):
        self.final_norm, self.eps = final_norm, eps
        self.hot_ids = hot_ids.to(lm_head.device)
        self.weight = lm_head.index_select(0, self.hot_ids).contiguous()  # [N, H]

    @classmethod
    def of_model(cls, model, hot_ids: torch.Tensor) -> "HotHead":
        return cls(model.final_norm, model.lm_head, model.eps, hot_ids)

    def guess(self, hidden: torch.Tensor) -> list[int]:
        """hidden [T, H] -> the best hot token of each row."""
        scores = F.linear(rms_norm(hidden, self.final_norm, self.eps), self.weight)  # [T, N]
        return self.hot_ids[scores.argmax(dim=-1)].tolist()


def usable(sampling: SamplingParams) -> str | None:
    """Why the hot head cannot decode with these settings (None: it can)."""
    if not sampling.greedy:
        return "the hot-vocabulary head decodes greedily only (temperature 0)"
    if (sampling.repetition_penalty != 1.0 or sampling.uses_generated or sampling.logit_bias):
        return "the hot-vocabulary head takes no penalties, logit bias or allowed-token mask"
    return None


def run_hot_head(engine, seq: list[int], logits: torch.Tensor, *, budget: int, sampling: SamplingParams,
                 logprobs: int, should_stop, stop_at_eos: bool, options: HotHeadOptions,
                 state: dict) -> Iterator[TokenEvent]:
    """Engine.generate's decode loop through the hot head (greedy): the plain loop's tokens."""
    from moestream.engine.speculative import SpeculativeStats

    reason = usable(sampling)
    if reason is not None:
        raise MoestreamError(reason)
    model = engine.model
    hot = HotHead.of_model(model, hot_vocabulary(seq, model.vocab_size, prompt_tokens=options.prompt_tokens,
                                                 base_tokens=options.base_tokens))
    stats = SpeculativeStats("hot-head", str(options.verify_every))
    state["speculative"] = stats
    seq = list(seq)
    produced = 0

    emit = Emitter(seq, state, sampling=sampling, logprobs=logprobs, eos_ids=engine.tokenizer.eos_token_ids,
                   should_stop=should_stop, stop_at_eos=stop_at_eos)

    if budget <= 0:
        return
    event = emit(logits[-1])
    if event is None:
        return
    produced += 1
    yield event
    while produced < budget:
        # the cache holds seq[:-1]; guesses run ahead of seq, saving each step's hidden row
        work, hidden = list(seq), []
        n = min(options.verify_every, budget - produced, engine.max_context - len(seq))
        with torch.inference_mode():
            for i in range(n):
                hidden.append(engine.step_hidden([work[-1]]))
                if i < n - 1:  # the last row's guess would never be run ahead on
                    work.append(hot.guess(hidden[-1])[0])
            stats.verify_steps += 1
            stats.drafted += n - 1
            rows = engine.head_rows(torch.cat(hidden))  # the full head once: plain decoding's bits
            for i in range(n):
                event = emit(rows[i])
                if event is None:
                    return
                produced += 1
                stats.step_tokens += 1
                yield event
                if i == n - 1 or event.token_id != work[len(seq) - 1]:
                    break
                stats.accepted += 1
        engine.rollback(len(seq) - 1)
