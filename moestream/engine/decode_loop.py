"""The decode loop: one sequence's tokens after its prefill, with a drafter or none.

Without a drafter every step runs one token. With one, a step runs the last token and the
drafter's k proposals: row i of its logits predicts the token after draft[:i], and a token's
logits are the same bits whatever the step's length, so choosing row i's token (argmax, or the
Gumbel-max draw keyed by (seed, position)) gives exactly the token plain decoding chooses there.
The loop keeps drafted tokens while they equal the model's own choice, takes the model's token at
the first difference (or the bonus token after the last draft) and the caller rolls the KV cache
back over the rejected ones. So the text is plain decoding's, greedy or sampled with a seed; the
drafter and the draft length (fixed, or the adaptive policy's) change only the speed.

`decode` is the loop of `Engine.generate` (one sequence over `step`); the server's batch scheduler
drives the same pieces (`Speculation.draft`, `verified`) over `step_many`. Plain greedy steps are
queued before the host reads the token they take (`_plain`), wherever the choice allows it."""
from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator, Protocol, Sequence

import torch

from moestream.engine.draft_policy import AdaptivePolicy
from moestream.engine.emitter import Emitter
from moestream.engine.speculative import Drafter, SpeculativeOptions, SpeculativeStats
from moestream.engine.types import TokenEvent


class Stepper(Protocol):
    """What the loop needs of an engine (moestream.engine.engine.Engine)."""

    max_context: int
    device: torch.device
    hidden_tap: Callable | None

    def step(self, tokens: list[int]) -> torch.Tensor: ...

    def step_unread(self, token: torch.Tensor) -> torch.Tensor: ...

    def name_token(self, position: int, token: int) -> None: ...

    def rollback(self, length: int) -> None: ...


def verified(emit: Emitter, rows: torch.Tensor, draft: Sequence[int], *, room: int,
             chosen: list[int] | None = None) -> Iterator[TokenEvent]:
    """The tokens one step's rows [len(draft) + 1, V] give: each row's choice while the draft before
    it was kept, at most `room`; stops where `emit` stops. `chosen`: the rows' argmaxes, already taken."""
    if chosen is None and draft:  # one host wait for the rows' greedy choices (None where they need more)
        chosen = emit.choices(rows[:len(draft) + 1])
    for i in range(min(len(draft) + 1, room)):
        event = emit(rows[i], None if chosen is None else chosen[i])
        if event is None:
            return
        yield event
        if i == len(draft) or event.token_id != draft[i]:
            return


class Speculation:
    """One sequence's drafting: its drafter, the draft length (fixed, or its policy's) and the
    receipt's figures."""

    def __init__(self, drafter: Drafter, *, draft_tokens: int | None, policy: AdaptivePolicy | None,
                 stats: SpeculativeStats):
        self.drafter, self.draft_tokens, self.policy, self.stats = drafter, draft_tokens, policy, stats
        self.accepted = 0  # drafted tokens the last verification kept

    @classmethod
    def of(cls, options: SpeculativeOptions, *, one_of_many: bool = False) -> "Speculation":
        """A generation's drafting by `options`: their policy (kept across generations), or for one
        sequence of a batch a policy of its own (each learns its own acceptance)."""
        if one_of_many:
            stats, policy = options.for_one_sequence()
        else:
            policy = options.policy
            stats = SpeculativeStats(options.drafter.name, "auto" if options.draft_tokens is None
                                     else str(options.draft_tokens), policy=policy)
        return cls(options.drafter, draft_tokens=options.draft_tokens, policy=policy, stats=stats)

    def length(self, limit: int) -> int:
        """How many tokens to draft when at most `limit` may be (0: a plain step)."""
        return min(self.draft_tokens, limit) if self.policy is None else self.policy.choose(limit)

    def draft(self, context: list[int], k: int) -> list[int]:
        """The drafter's proposal of up to k tokens after `context`, timed."""
        t0 = time.perf_counter()
        draft = self.drafter.propose(context, k)[:k] if k > 0 else []
        seconds = time.perf_counter() - t0
        self.stats.draft_s += seconds
        if self.policy is not None:
            self.policy.record_draft(k, seconds)
        return draft

    def verify(self, emit: Emitter, rows: torch.Tensor, k: int, draft: list[int], *, room: int,
               started: float, step_s: float | None = None) -> Iterator[TokenEvent]:
        """`verified`'s tokens, recorded: the step is timed from `started` to its first row's choice,
        read on the host where a plain step's time ends too (or `step_s`, measured by the caller)."""
        st, events, self.accepted = self.stats, verified(emit, rows, draft, room=room), 0
        first = next(events, None)
        seconds = time.perf_counter() - started if step_s is None else step_s
        st.verify_steps += 1
        st.drafted += len(draft)
        st.verify_s += seconds
        st.draft_lengths[len(draft)] = st.draft_lengths.get(len(draft), 0) + 1
        if self.policy is not None:
            self.policy.record_step(len(draft) + 1, seconds)
        try:
            for i, event in enumerate(itertools.chain([] if first is None else [first], events)):
                st.step_tokens += 1
                self.accepted += i < len(draft) and event.token_id == draft[i]
                yield event
        finally:
            st.accepted += self.accepted
            st.record(k, len(draft), self.accepted, seconds)
            self.drafter.observe(len(draft), self.accepted)
            if self.policy is not None:
                self.policy.record_accept(len(draft), self.accepted)

    def plain_steps(self, most: int) -> int:
        """How many plain steps in a row to run now that the length chosen is 0 (at most `most`)."""
        return most if self.policy is None else min(most, self.policy.plain_stretch())

    def took_plain(self, steps: int, seconds: float) -> None:
        self.stats.plain_stretch(steps, seconds)
        if self.policy is not None:
            self.policy.took_plain(steps, seconds / steps)

    def begin(self, engine: Stepper, sampling) -> None:
        """A generation starts: the drafter learns the sampling settings, the policy its first probe's
        price, and the steps a verification may take are captured now rather than inside a timed step."""
        self.drafter.begin(sampling)
        if self.policy is not None:
            self.policy.begin()
            if self.policy.probe_s <= 0:  # no probe paid yet: the drafter's own estimate prices the first
                self.policy.probe_s = self.drafter.probe_price_s
        most = self.policy.max_draft if self.policy is not None else self.draft_tokens
        for e in (engine, getattr(self.drafter, "engine", None)):
            warm = getattr(e, "warm_steps", None)
            if warm is not None:
                warm(most + 1)


def decode(engine: Stepper, emit: Emitter, logits: torch.Tensor, budget: int, *,
           speculation: Speculation | None = None) -> Iterator[TokenEvent]:
    """Up to `budget` tokens, the first chosen from `logits`' last row (the prefill's), each through
    `emit` (which stops the loop at an end token or a cancel). The cache then holds every token
    emitted but the last (after a stop in plain greedy decoding, the last too)."""
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


def _plain(engine: Stepper, emit: Emitter, logits: torch.Tensor, budget: int) -> Iterator[TokenEvent]:
    """Plain decoding of up to `budget` tokens, the first chosen from `logits`' last row. Where the
    choice is the raw row's argmax with nothing read on the host (no log-probabilities, no hidden-state
    tap), each step is queued before the host reads the token it takes; else one step a token."""
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


def _ahead(engine: Stepper, emit: Emitter, logits: torch.Tensor, budget: int) -> Iterator[TokenEvent]:
    """Greedy decoding that keeps the device busy: step n + 1 is queued with token n still on the
    device (its argmax), then the host reads token n while the step runs, names it in the cache,
    and checks the stops. The same tokens as one step at a time (the same steps, fed the same ids);
    a stop leaves one step more in the cache, the KV of a real token at its position, which the next
    prompt reuses or truncates like any other. On the CPU nothing overlaps, but it is the same path."""
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
