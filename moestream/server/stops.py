"""Stop strings on decoded text, incremental detokenization that never splits a character, and
ChoiceText, which runs a choice's tokens through both into the TextDeltas its client gets.

They run on the worker thread, between the engine's tokens and the HTTP side's deltas, so a
streamed reply and a whole one are built from exactly the same pieces and always agree.

A stop string may span several tokens, and a token may hold several characters. The matcher keeps
back the shortest tail of the text that could still grow into a stop string and releases it once
it cannot. When several stop strings occur, the one that is complete first (the earliest end; on a
tie, the one that starts first) wins: that is what a reader going character by character would
see, so the cut never depends on how the text was split into tokens.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Optional

from moestream.server.jobs import Job, TextDelta, TokenLogprobInfo

REPLACEMENT_CHAR = "\ufffd"


class StopMatcher:
    """Feed decoded text piece by piece; get back the text that is safe to show.

    After a stop string is found, `stopped` is true, the text before it has been released, and
    everything after it is dropped. At the end of a generation without a stop, `flush()` releases
    the kept-back tail.
    """

    def __init__(self, stops: Iterable[str] = ()) -> None:
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(s for s in stops if s))
        self.stopped = False
        self.matched: str | None = None
        self._held = ""
        # every proper prefix of every stop string: a held tail must be one of these
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._longest = max((len(s) for s in self.stops), default=0)

    def feed(self, text: str) -> str:
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buffer = self._held + text
        cut = self._first_stop(buffer, len(self._held))
        if cut is not None:
            self.stopped = True
            self._held = ""
            return buffer[:cut]
        keep = self._held_tail_length(buffer)
        self._held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[: len(buffer) - keep]

    def flush(self) -> str:
        """The kept-back tail, when the generation ended without a stop string."""
        if self.stopped:
            return ""
        held, self._held = self._held, ""
        return held

    def _first_stop(self, buffer: str, new_from: int) -> int | None:
        # No stop string was complete before the new text arrived, so every occurrence ends in it.
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self.stops:
            start = buffer.find(stop, max(0, new_from - len(stop) + 1))
            if start >= 0:
                key = (start + len(stop), start)
                if best is None or key < best:
                    best = key
                    self.matched = stop
        return None if best is None else best[1]

    def _held_tail_length(self, buffer: str) -> int:
        # the longest suffix of the buffer that is a proper prefix of a stop string
        for length in range(min(len(buffer), self._longest - 1), 0, -1):
            if buffer[len(buffer) - length:] in self._prefixes:
                return length
        return 0


class IncrementalDecoder:
    """Turns token ids into text deltas without ever emitting half of a UTF-8 character.

    Decodes a short window of recent tokens and emits only the part past what was already shown,
    and only when the window's text does not end in U+FFFD (an incomplete byte sequence that the
    next token may finish). Windows start where the last emitted text ended, so tokenizers that
    treat a leading space specially still decode the same as the whole sequence would.
    """

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode
        self._ids: list[int] = []
        self._prefix_offset = 0  # window start
        self._read_offset = 0  # tokens up to here have been emitted

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        shown = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        if len(text) > len(shown) and not text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return text[len(shown):]
        return ""

    def flush(self) -> str:
        """Whatever is still pending at the end (an incomplete sequence decodes as U+FFFD)."""
        if self._read_offset == len(self._ids):
            return ""
        shown = self._decode(self._ids[self._prefix_offset:self._read_offset])
        text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return text[len(shown):]


class ChoiceText:
    """One choice's tokens on their way out: detokenized, cut at a stop string, delivered as
    TextDeltas (each with the log-probabilities of the tokens whose text it shows), and timed for the
    latency figures: the first token since the job was queued (its first choice only: a later one
    waited for the earlier ones, not the queue), then the gap before each next one."""

    def __init__(self, worker: Any, job: Job, index: int) -> None:  # worker: the server.worker.Worker
        self.worker, self.job, self.index = worker, job, index
        self.decode = worker.tokenizer.decode
        self.decoder = IncrementalDecoder(self.decode)
        self.matcher = StopMatcher(job.stops)
        self.pending: list[TokenLogprobInfo] = []  # of the tokens whose text is held back
        self.generated = self.shown = 0  # tokens generated, and those whose text was delivered
        self.last_token_at: Optional[float] = None

    def token(self, event: Any) -> None:
        """The engine's next TokenEvent."""
        self.generated += 1
        now = time.monotonic()
        if self.last_token_at is not None:
            self.worker._observe("inter_token", now - self.last_token_at)
        elif self.index == 0:
            self.worker._observe("first_token", now - self.job.enqueued_at)
        self.last_token_at = now
        if self.job.logprobs is not None:
            top = [(self.decode([tid]), float(lp)) for tid, lp in (event.top_logprobs or [])[:self.job.logprobs]]
            logprob = float(event.logprob) if event.logprob is not None else 0.0
            self.pending.append(TokenLogprobInfo(self.decode([event.token_id]), logprob, top))
        self._send(self.matcher.feed(self.decoder.push(event.token_id)))

    def flush(self) -> None:
        """The generation ended without a stop string: the text held back goes out."""
        self._send(self.matcher.feed(self.decoder.flush()) + self.matcher.flush())

    def _send(self, text: str) -> None:
        if text:
            self.worker._deliver(self.job, TextDelta(text, self.pending, self.index, self.generated - self.shown))
            self.pending, self.shown = [], self.generated
