"""The decode loop: one sequence's tokens after its prefill, with a drafter or none.

With a drafter a step runs the last token and the k proposals: row i predicts the token after
draft[:i] with the bits of a step of its own, so choosing row i's token (argmax, or the Gumbel-max
draw keyed by (seed, position)) gives the token plain decoding chooses there. Drafted tokens are kept
while they equal the model's choice, the model's token taken at the first difference (or after the
last draft), the cache rolled back over the rest: the text is plain decoding's, the drafter changes
only the speed. The server's batch scheduler drives the same pieces over `step_many`. Plain greedy
steps are queued before the host reads the token they take (`_ahead`)."""
from __future__ import annotations

import time
from typing import Iterator

import torch

from moestream.engine import timeline
from moestream.engine.emitter import Emitter
from moestream.engine.speculative import Speculation
from moestream.engine.types import TokenEvent


def decode(engine, emit: Emitter, logits: torch.Tensor, budget: int, *,
           speculation: Speculation | None = None) -> Iterator[TokenEvent]:
    """Up to `budget` tokens of `engine` (an Engine), the first from `logits`' last row, each through
    `emit` (which stops the loop). The cache then holds every token emitted but the last."""
    if speculation is None:
        yield from _plain(engine, emit, logits, budget)
        return
    seq = emit.seq
    event = emit(logits[-1]) if budget > 0 else None
    if event is None:
        return
    produced = 1
    yield event
    while produced < budget:
        # the cache holds seq[:-1]; seq[-1] is the next token to run
        limit = min(budget - produced - 1, engine.max_context - len(seq))
        k = speculation.length(limit)
        if k == 0 and limit > 0:  # plain steps until the policy's next probe: plain decoding
            n = speculation.plain_steps(limit + 1)
            if n > 1:
                t0, got = time.perf_counter(), 0
                for event in _plain(engine, emit, engine.step([seq[-1]]), n):
                    got += 1
                    produced += 1
                    yield event
                if got < n:  # a stop
                    return
                speculation.took_plain(n, time.perf_counter() - t0)
                continue
        draft = speculation.draft(seq, k)
        started = time.perf_counter()
        rows = speculation.drafter.verify_rows(engine, seq, draft) if draft else engine.step([seq[-1]])
        for event in speculation.verify(emit, rows, k, draft, room=budget - produced, started=started):
            produced += 1
            yield event
        if emit.stopped:
            return
        if speculation.accepted < len(draft):
            engine.rollback(len(seq) - 1)  # forget the rejected drafts


def _plain(engine, emit: Emitter, logits: torch.Tensor, budget: int) -> Iterator[TokenEvent]:
    """Plain decoding of up to `budget` tokens: `_ahead` where the choice is the raw row's argmax and
    nothing else is read on the host (log-probabilities, the hidden-state tap), else a step a token."""
    if emit.plain_argmax and not emit.logprobs and engine.hidden_tap is None:
        yield from _ahead(engine, emit, logits, budget)
        return
    for n in range(budget):
        event = emit(logits[-1])
        if event is None:
            return
        yield event
        if n + 1 < budget:
            logits = engine.step([event.token_id])


def _ahead(engine, emit: Emitter, logits: torch.Tensor, budget: int) -> Iterator[TokenEvent]:
    """Greedy decoding that keeps the device busy: step n + 1 is queued with token n still on the device,
    then the host reads token n while it runs, names it in the cache and checks the stops. The same
    tokens as a step at a time; a stop leaves one more real token in the cache (the next prompt reuses
    or truncates it like any other)."""
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
            with timeline.span("sample", position=len(emit.seq)):  # the host's share of choosing: the read
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
