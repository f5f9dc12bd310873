"""A forced tool call that is complete before max_tokens.

The grammar makes every token of a call valid, but not the call finished: a model may keep writing a
string, or more items, until its token budget runs out, and the reply is then cut-off JSON rather
than a call. So the mask looks ahead: how many tokens the quickest way to finish takes from here
(the open string ended, the arrays and objects closed, the keys they require given their shortest
values, the call's closing markup), found by walking the grammar greedily. When the tokens left come
within MARGIN of that, the mask allows only that walk's next token from then on, and the call ends
within the budget (cut short, but whole).

The look-ahead runs at the first step and then ever more often as the slack shrinks, so a long
call pays for a few dozen walks, not one per token. Its state is kept per position and rolls back
with the grammar, so the same tokens always get the same mask (speculative decoding stays exact).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

MARGIN = 8  # tokens of slack kept: one token may open an object whose required keys the walk must add
OUTSIDE, IN_STRING, ESCAPED = 0, 1, 2  # where the text stands in JSON's strings
QUOTE, BACKSLASH = ord('"'), ord("\\")


def scan(state: int, data: bytes) -> int:
    """The string state after `data` (only strings matter: outside them `}` closes, inside it is text)."""
    for b in data:
        if state == OUTSIDE:
            state = IN_STRING if b == QUOTE else OUTSIDE
        elif state == IN_STRING:
            state = ESCAPED if b == BACKSLASH else OUTSIDE if b == QUOTE else IN_STRING
        else:
            state = IN_STRING
    return state


class ClosingVocab:
    """What the walk needs of the vocabulary: each token's bytes and length, the end tokens, and the
    single-character tokens that finish JSON soonest, in the order they are preferred."""

    def __init__(self, ll: Any, eos: Sequence[int], enders: Sequence[str] = ()) -> None:
        """`enders`: markers that end a run of calls (tried first where the grammar allows them)."""
        import numpy as np

        self.size = ll.vocab_size
        self.bytes = [ll.decode_bytes([i]) for i in range(self.size)]
        self.lengths = np.array([len(b) for b in self.bytes], dtype=np.int64)
        self.eos = [e for e in eos if e < self.size]
        self.lengths[self.eos] = -1  # the walk's fallback never picks an end token
        single = {c: ids[0] for c in '}]10",' if len(ids := ll.tokenize_str(c)) == 1}
        ends = [ids[0] for m in enders if len(ids := ll.tokenize_str(m, parse_special=True)) == 1]
        # outside a string: end the calls, close, a digit (1 before 0: `0.` could go on for ever
        # under exclusiveMinimum 0), an empty string, then the next item; in a string `"` ends it
        # (after a backslash it is the escaped character, and the next one ends it)
        self.prefer = {OUTSIDE: ends + list(single.values()), IN_STRING: [single[c] for c in '"' if c in single]}
        self.prefer[ESCAPED] = self.prefer[IN_STRING]

    def choice(self, matcher: Any, state: int, bits: Any = None) -> Optional[int]:
        """The walk's next token from `matcher`'s state: an end token once the grammar is complete,
        a forced token, the preferred single character, else the longest token allowed; None when
        nothing is allowed. `bits`: its allowed-token mask when already computed."""
        import numpy as np

        if bits is None:
            bits = unpack(matcher.compute_bitmask(), self.size)
        if matcher.is_accepting() or matcher.is_stopped():
            ends = [e for e in self.eos if bits[e]]
            if ends or matcher.is_stopped():
                return ends[0] if ends else None
        forced = matcher.compute_ff_tokens()
        if forced:
            return forced[0]
        for token in self.prefer[state]:
            if bits[token]:
                return token
        allowed = np.flatnonzero(bits[: self.size])
        return int(allowed[np.argmax(self.lengths[allowed])]) if len(allowed) else None

    def need(self, matcher: Any, state: int, limit: int) -> int:
        """How many tokens the walk takes to finish from `matcher`, the end token included (the
        engine must still draw it within the budget, though it is not counted as output); more
        than `limit` when it does not finish within it."""
        m = matcher.deep_copy()
        for steps in range(limit + 1):
            token = self.choice(m, state)
            if token is None:
                return steps
            if token in self.eos:
                return steps + 1
            if not m.consume_token(token):
                break
            state = scan(state, self.bytes[token])
        return limit + 1


def unpack(bitmask: Any, size: int) -> Any:
    import numpy as np

    return np.unpackbits(np.frombuffer(bitmask, dtype=np.uint8), bitorder="little")[:size].astype(bool)


class Closing:
    """One sequence's look-ahead: per position, (the string state, whether it is closing, the tokens
    left at which it looks again), so that a rollback restores it exactly."""

    def __init__(self, vocab: ClosingVocab, budget: int) -> None:
        self.vocab, self.budget = vocab, budget
        self._states = [(OUTSIDE, False, budget)]  # at the start of each position
        self._decided: Optional[tuple[int, bool, int]] = None  # (position, closing, next look)

    def consumed(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            k = len(self._states) - 1
            state, closing, look = self._states[k]
            if self._decided is not None and self._decided[0] == k:
                closing, look = self._decided[1], self._decided[2]
            self._states.append((scan(state, self.vocab.bytes[token]) if token < self.vocab.size else state,
                                 closing, look))

    def rolled_back(self, length: int) -> None:
        del self._states[length + 1:]
        if self._decided is not None and self._decided[0] > length:
            self._decided = None

    def only(self, matcher: Any, bits: Any) -> Optional[int]:
        """The one token allowed at the current position, or None when the model may choose."""
        k = len(self._states) - 1
        state, closing, look = self._states[k]
        left = self.budget - k
        if self._decided is not None and self._decided[0] == k:
            closing, look = self._decided[1], self._decided[2]
        elif not closing and left <= look:
            need = self.vocab.need(matcher, state, left)
            closing = left - need <= MARGIN
            look = left - max(1, (left - need - MARGIN) // 4)  # sooner as the slack shrinks
            self._decided = (k, closing, look)
        return self.vocab.choice(matcher, state, bits) if closing else None
