"""Plain data the engine takes and gives: sampling settings, per-token events, the result of a run.

These types cross to the server's worker thread, so they hold only Python values, never tensors.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen. temperature 0 is greedy; top_k 0 and top_p 1 mean off."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


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
