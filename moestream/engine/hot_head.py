"""The hot-vocabulary head: a drafter for greedy decoding that scores only a list of common tokens.

To draft k tokens it runs k + 1 steps that stop before the head (`Engine.step_hidden`), each fed the
previous step's best token of a short list (the context's most frequent tokens and the tokenizer's
first ids, which byte-pair merges order roughly by frequency). Those steps are the verification's:
the full head of the saved rows (`Engine.head_rows`) verifies the guesses, so the tokens are plain
greedy decoding's. It saves the full head's weight read on all but one of each k + 1 steps on CUDA;
on the CPU the head's cost grows with its rows, so there it is exact, not faster (docs/PERFORMANCE.md)."""
from __future__ import annotations

from collections import Counter
from typing import Sequence

import torch
import torch.nn.functional as F

from moestream.engine.speculative import Drafter
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError
from moestream.layers.norm import rms_norm

DRAFT_TOKENS = 3  # guesses between full-head passes (--hot-head)


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


class HotHeadDrafter(Drafter):
    """Drafts for `engine` (slot 0) with the hot head; its proposal runs the verification's steps."""

    name = "hot-head"

    def __init__(self, engine, *, prompt_tokens: int = 256, base_tokens: int = 4096):
        if prompt_tokens < 0 or base_tokens < 0 or prompt_tokens + base_tokens == 0:
            raise MoestreamError("the hot-vocabulary list needs prompt or base tokens")
        self.engine, self.prompt_tokens, self.base_tokens = engine, prompt_tokens, base_tokens
        self.hot: HotHead | None = None  # made from the context of a generation's first draft
        self.hidden: list[torch.Tensor] = []  # the last proposal's rows [1, H], one per step

    def refuses(self, sampling: SamplingParams) -> str | None:
        return usable(sampling)

    def begin(self, sampling: SamplingParams) -> None:
        reason = usable(sampling)
        if reason is not None:
            raise MoestreamError(reason)
        self.hot = None

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """k guesses after `context`, each the hot head's best after the step of the token before it;
        the cache then holds context and the guesses (rows saved for verify_rows)."""
        model, work = self.engine.model, list(context)
        if self.hot is None:
            hot_ids = hot_vocabulary(work, model.vocab_size, prompt_tokens=self.prompt_tokens,
                                     base_tokens=self.base_tokens)
            self.hot = HotHead(model.final_norm, model.lm_head, model.eps, hot_ids)
        self.hidden = []
        with torch.inference_mode():
            for i in range(k + 1):
                self.hidden.append(self.engine.step_hidden([work[-1]]))
                if i < k:  # the last row is the bonus token's: nothing runs ahead on it
                    work.append(self.hot.guess(self.hidden[-1])[0])
        return work[len(context):]

    def verify_rows(self, engine, context: Sequence[int], draft: list[int]) -> torch.Tensor:
        if engine is not self.engine or len(self.hidden) != len(draft) + 1:
            raise ValueError("the hot head verifies only its own last proposal, on its engine")
        return engine.head_rows(torch.cat(self.hidden))  # the full head once: plain decoding's bits
