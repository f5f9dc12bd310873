"""Plain decoding's choice at one position: the token, its event, and the stop checks.

The decode loop (plain steps, every drafter's verification) and the server's batch scheduler all
choose through one Emitter, so that they give the same tokens (and log-probabilities) for the same
logits."""
from __future__ import annotations

from typing import Callable, Iterator, Sequence

import torch

from moestream.engine import timeline
from moestream.engine.sampling import argmax_rows, choose_token, plain_argmax
from moestream.engine.types import SamplingParams, TokenEvent


def top_logprobs(row: torch.Tensor, token: int, n: int) -> tuple[float, list[tuple[int, float]]]:
    """The chosen token's log-probability and the n most likely (token, logprob) of the raw distribution."""
    lp = torch.log_softmax(row, dim=-1)
    top = torch.topk(lp, min(n, lp.numel()))
    return float(lp[token]), [(int(i), float(v)) for v, i in zip(top.values, top.indices)]


class Emitter:
    """Appends each chosen token to `seq` and to state["tokens"]; sets state["finish"] when it stops."""

    def __init__(self, seq: list[int], state: dict, *, sampling: SamplingParams, logprobs: int,
                 eos_ids, should_stop: Callable[[], bool] | None, stop_at_eos: bool):
        self.seq, self.state, self.sampling, self.logprobs = seq, state, sampling, logprobs
        self.eos_ids, self.should_stop, self.stop_at_eos = eos_ids, should_stop, stop_at_eos
        self.stopped = False  # whether it has stopped (an end token, or should_stop said so)

    def take(self, rows: torch.Tensor, draft: Sequence[int] = (), *, room: int,
             chosen: list[int] | None = None) -> Iterator[TokenEvent]:
        """The tokens a step's rows [len(draft) + 1, V] give: each row's choice while the draft before it
        was kept, at most `room`, until this Emitter stops. `chosen`: the rows' argmaxes, if taken."""
        if chosen is None and draft:  # one host wait for the rows' greedy choices (None where they need more)
            chosen = self.choices(rows[:len(draft) + 1])
        for i in range(min(len(draft) + 1, room)):
            event = self(rows[i], None if chosen is None else chosen[i])
            if event is None:
                return
            yield event
            if i == len(draft) or event.token_id != draft[i]:
                return

    def choices(self, rows: torch.Tensor) -> list[int] | None:
        """What __call__ would choose from each of rows [n, V], all read at once (one host wait for a
        verification's rows) where the choice needs nothing but each row (`plain_argmax`); else None."""
        return argmax_rows(list(rows)) if self.plain_argmax else None

    @property
    def plain_argmax(self) -> bool:
        """Whether its choice is the raw row's argmax (a caller may then pass it in, `chosen`)."""
        return plain_argmax(self.sampling)

    def __call__(self, row: torch.Tensor, chosen: int | None = None) -> TokenEvent | None:
        """The token plain decoding chooses at len(seq) from logits `row`, as an event; None: stop.
        `chosen`: the row's argmax, already taken (argmax_rows) where `plain_argmax`."""
        if self.should_stop is not None and self.should_stop():
            self.state["finish"], self.stopped = "cancelled", True
            return None
        seq, sampling = self.seq, self.sampling
        if chosen is not None:
            if not self.plain_argmax:
                raise ValueError("a chosen token is only taken for plain greedy choices")
            token = int(chosen)
        else:
            previous = torch.tensor(seq, device=row.device) if sampling.repetition_penalty != 1.0 else None
            with timeline.span("sample", position=len(seq)):
                token = choose_token(row, sampling, position=len(seq), previous=previous)
        if self.stop_at_eos and token in self.eos_ids:
            self.state["finish"], self.stopped = "stop", True
            return None
        event = TokenEvent(token)
        if self.logprobs:
            event.logprob, event.top_logprobs = top_logprobs(row, token, self.logprobs)
        seq.append(token)
        self.state["tokens"].append(token)
        return event
