"""Plain data the engine takes and gives: sampling settings, per-token events, the result of a run.

These types cross to the server's worker thread, so they hold only Python values, never tensors.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from moestream.kv.blocks import common_prefix  # noqa: F401 (prefix reuse: the engine's and the server's name for it)

# tokens generated so far -> which tokens may come next (a numpy bool array [V], or None: any); e.g. a
# grammar. The sampler applies it after the penalties and the bias, before the sampling filters.
AllowedTokens = Callable[[Sequence[int]], Any]


class TokenHistory:
    """The tokens a sampler chose, by position, for the settings that depend on them when the caller
    does not pass them; re-choosing a position (a rollback) forgets everything from there on."""

    def __init__(self) -> None:
        self._start: int | None = None
        self._tokens: list[int] = []

    def before(self, position: int) -> list[int]:
        """The generated tokens at positions before `position` (the first call fixes where
        generation started)."""
        if self._start is None:
            self._start = position
        return self._tokens[: max(0, position - self._start)]

    def record(self, position: int, token: int) -> None:
        if self._start is None:
            self._start = position
        del self._tokens[max(0, position - self._start):]
        self._tokens.append(int(token))


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 is greedy; top_k 0 and top_p 1 mean off.

    frequency_penalty and presence_penalty follow OpenAI: over the tokens generated so far (not the
    prompt), logit -= frequency_penalty * count + presence_penalty * (count > 0). logit_bias adds a
    bias to a token id's logit (-100 bans it, 100 all but forces it)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    allowed_tokens: Optional[AllowedTokens] = field(default=None, compare=False, repr=False)
    # where the generated tokens come from when the caller of choose_token does not pass them
    history: Optional[TokenHistory] = field(default=None, compare=False, repr=False)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def uses_generated(self) -> bool:
        """Whether choosing a token depends on the tokens generated before it."""
        return bool(self.frequency_penalty or self.presence_penalty or self.allowed_tokens is not None)


@dataclass
class TokenEvent:
    """One generated token. `top_logprobs` holds the N most likely (token_id, logprob) pairs of the
    model's raw distribution (log-softmax of the logits, before sampling filters) when asked for."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass
class GenerationResult:
    """The end of one generation: why it ended, what it produced and the receipt of the run."""

    token_ids: list[int]
    finish_reason: str  # "stop" (EOS), "length" (max tokens or context), "cancelled" (should_stop said so)
    receipt: Mapping = field(default_factory=dict)  # a moestream.engine.receipt.Receipt


