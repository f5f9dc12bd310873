"""Speculative decoding's pieces: the drafters (prompt lookup, a draft model; the model's MTP layer
in mtp_drafter.py, the hot-vocabulary head in hot_head.py), the options a run speculates with and
the receipt's figures, and one sequence's drafting (Speculation: draft, verify, record). The loop
is moestream.engine.decode_loop; every drafter only changes the speed, never the tokens.

How many tokens to draft is a choice (`draft_tokens`) or the AdaptivePolicy's (moestream.engine.draft_policy)."""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator, Sequence

import torch

from moestream.engine.sampling import choose_token
from moestream.engine.draft_policy import AdaptivePolicy
from moestream.engine.types import SamplingParams, TokenEvent
from moestream.errors import MoestreamError

if TYPE_CHECKING:
    from moestream.engine.emitter import Emitter

class Drafter:
    """Proposes the tokens likely to follow a context. It never changes the output, only the speed."""

    name = "drafter"
    many_sequences = False  # whether one instance may draft for several sequences in turn (batching)

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        """Up to k tokens likely to follow `context` (fewer, or none, when it has no guess)."""
        raise NotImplementedError

    def observe(self, drafted: int, accepted: int) -> None:
        """How many of the last proposal's tokens were drafted and how many of them were kept."""

    def begin(self, sampling: SamplingParams) -> None:
        """A generation starts with these sampling settings."""

    def refuses(self, sampling: SamplingParams) -> str | None:
        """Why it cannot draft for these sampling settings (None: it can). Drafts are verified through
        the same Emitter as plain decoding, penalties, grammar and logit bias included."""
        return None

    def verify_rows(self, engine, context: Sequence[int], draft: list[int]) -> torch.Tensor:
        """The logits [len(draft) + 1, V] of the step that runs context[-1] and `draft` (the cache holds
        context[:-1]); a drafter whose proposal ran the model gives them its own way, with these bits."""
        return engine.step([context[-1]] + draft)

    def reset(self) -> None:
        """Forget any state kept between generations."""

    def close(self) -> None:
        pass

    @property
    def probe_price_s(self) -> float:
        """What a probe after plain steps costs beyond them, as far as known before the first (0: cheap
        or unknown; the policy then learns it from the first probe)."""
        return 0.0


class NGramDrafter(Drafter):
    """Prompt lookup: what followed the latest earlier occurrence of the context's last n tokens (n
    from `max_ngram` down to `min_ngram`). Strong wherever text repeats (code, edits, quotes)."""

    name = "ngram"
    many_sequences = True  # no state of its own: one drafter serves every sequence of a batch

    def __init__(self, *, max_ngram: int = 3, min_ngram: int = 1):
        if not 1 <= min_ngram <= max_ngram:
            raise MoestreamError(f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        ctx = list(context)
        L = len(ctx)
        if k <= 0:
            return []
        for n in range(min(self.max_ngram, L - 1), self.min_ngram - 1, -1):
            pattern = ctx[L - n:]
            first = pattern[0]
            # latest start i < L - n with ctx[i:i + n] == pattern (the suffix itself excluded)
            for i in range(L - n - 1, -1, -1):
                if ctx[i] == first and ctx[i:i + n] == pattern:
                    return ctx[i + n:i + n + k]
        return []


class ModelDrafter(Drafter):
    """A drafter with a model of its own that chooses as the main model would (greedily, or the same
    Gumbel-max draw at the same position), so a draft matches when their scores agree."""

    def __init__(self):
        self.sampling = SamplingParams()

    def begin(self, sampling: SamplingParams) -> None:
        # the draw only, never the main sampler's history, penalties or grammar
        self.sampling = SamplingParams(temperature=sampling.temperature, top_k=sampling.top_k,
                                       top_p=sampling.top_p, min_p=sampling.min_p, seed=sampling.seed)

    def _choose(self, row: torch.Tensor, position: int) -> int:
        if self.sampling.greedy:
            return int(torch.argmax(row))
        return choose_token(row, self.sampling, position=position)


class DraftModelDrafter(ModelDrafter):
    """A small model sharing the main model's tokenizer, run as its own Engine. Each proposal prefills
    its cache to the context (reusing the common prefix: the rollback after rejected drafts); between
    proposals it runs nothing (the policy counts that catch-up in a probe's cost)."""

    name = "draft"

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self._price: float | None = None

    @property
    def probe_price_s(self) -> float:
        """A probe after plain steps first prefills what this engine has not seen: timed once (PRICE_TOKENS
        tokens, the second of two runs), the engine left empty. On a fast GPU it costs more than many
        plain steps (demo model, H200: ~10 ms against 0.23 ms a token)."""
        if self._price is None:
            e = self.engine
            tokens = [(7 * i + 3) % e.args.vocab_size for i in range(min(PRICE_TOKENS, e.max_context - 1))]
            times = []
            for _ in range(2):
                e.reset()
                t0 = time.perf_counter()
                e.prefill(tokens)
                e._sync()
                times.append(time.perf_counter() - t0)
            e.reset()
            self._price = times[-1]
        return self._price

    def propose(self, context: Sequence[int], k: int) -> list[int]:
        ctx = list(context)
        room = self.engine.max_context - len(ctx)
        k = min(k, room)
        if k <= 0:
            return []
        logits, _ = self.engine.prefill(ctx)
        draft = [self._choose(logits[-1], len(ctx))]
        while len(draft) < k:
            logits = self.engine.step([draft[-1]])
            draft.append(self._choose(logits[-1], len(ctx) + len(draft)))
        return draft

    def reset(self) -> None:
        self.engine.reset()

    def close(self) -> None:
        self.engine.close()


PRICE_TOKENS = 64  # the catch-up a draft engine's probe price is timed on
@dataclass
class SpeculativeOptions:
    """How `Engine.generate` speculates: a drafter, and a fixed draft length or the adaptive policy
    (draft_tokens None) drafting at most max_draft_tokens."""

    drafter: Drafter
    draft_tokens: int | None = None
    max_draft_tokens: int = 8
    policy: AdaptivePolicy | None = field(default=None, repr=False)  # kept across generations

    def __post_init__(self):
        if self.draft_tokens is not None and self.draft_tokens < 0:
            raise MoestreamError(f"draft tokens must be >= 0, not {self.draft_tokens}")
        if self.max_draft_tokens < 1:
            raise MoestreamError(f"the most draft tokens must be >= 1, not {self.max_draft_tokens}")
        if self.draft_tokens is None and self.policy is None:
            self.policy = AdaptivePolicy(self.max_draft_tokens)

    def for_generation(self) -> "Speculation":
        """A generation's drafting, with these options' policy (kept across generations)."""
        return self._speculation(self.policy)

    def for_one_sequence(self) -> "Speculation":
        """The drafting of one sequence of a batch, with a policy of its own (each learns its own acceptance)."""
        return self._speculation(None if self.draft_tokens is not None else AdaptivePolicy(self.max_draft_tokens))

    def _speculation(self, policy: AdaptivePolicy | None) -> "Speculation":
        mode = "auto" if self.draft_tokens is None else str(self.draft_tokens)
        return Speculation(self.drafter, draft_tokens=self.draft_tokens, policy=policy,
                           stats=SpeculativeStats(self.drafter.name, mode, policy=policy))

    def not_used_reason(self, sampling: SamplingParams) -> str | None:
        """Why these options cannot decode with `sampling` (None: they can)."""
        return self.drafter.refuses(sampling)


MAX_STEP_RECORDS = 2048  # verifications whose decision the receipt lists one by one (a long run keeps its first)
STEP_FIELDS = ["chosen", "drafted", "accepted", "verify_ms"]


@dataclass
class SpeculativeStats:
    drafter: str
    mode: str  # "auto" or the fixed draft length
    verify_steps: int = 0  # engine.step calls of the loop (plain ones included)
    drafted: int = 0
    accepted: int = 0
    step_tokens: int = 0  # tokens emitted from those steps' logits
    draft_s: float = 0.0
    verify_s: float = 0.0
    draft_lengths: dict = field(default_factory=dict)  # k -> verifications that drafted k
    policy: "AdaptivePolicy | None" = None  # its learned step costs go in the receipt
    steps: list = field(default_factory=list)  # per verification: STEP_FIELDS
    plain_stretches: int = 0  # runs of plain steps decoded as plain decoding (not in steps)

    def record(self, chosen: int, drafted: int, accepted: int, verify_s: float) -> None:
        """One verification: the length chosen, the tokens drafted (maybe fewer) and kept, its time."""
        if len(self.steps) < MAX_STEP_RECORDS:
            self.steps.append([chosen, drafted, accepted, round(verify_s * 1000.0, 3)])

    def plain_stretch(self, steps: int, seconds: float) -> None:
        """`steps` plain steps run as plain decoding (each a verification of 0 drafted tokens)."""
        for _ in range(steps):
            self.record(0, 0, 0, seconds / steps)
        self.verify_steps += steps
        self.step_tokens += steps
        self.verify_s += seconds
        self.draft_lengths[0] = self.draft_lengths.get(0, 0) + steps
        self.plain_stretches += 1

    def to_json(self) -> dict:
        return {"drafter": self.drafter, "draft_tokens": self.mode, "verify_steps": self.verify_steps,
                "drafted": self.drafted, "accepted": self.accepted,
                "accept_rate": round(self.accepted / self.drafted, 6) if self.drafted else None,
                "tokens_per_step": round(self.step_tokens / self.verify_steps, 6) if self.verify_steps else None,
                "draft_s": round(self.draft_s, 6), "verify_s": round(self.verify_s, 6),
                "draft_lengths": {str(k): v for k, v in sorted(self.draft_lengths.items())},
                "step_s_by_tokens": None if self.policy is None else
                {str(t): round(c, 6) for t, c in sorted(self.policy.step_cost.items())},
                "acceptance_estimate": None if self.policy is None else round(self.policy.acceptance, 4),
                "plain_stretches": self.plain_stretches,
                "step_fields": STEP_FIELDS, "steps": self.steps,
                "steps_truncated": self.verify_steps > len(self.steps)}


class Speculation:
    """One sequence's drafting: its drafter, the draft length (fixed, or its policy's) and the
    receipt's figures."""

    def __init__(self, drafter: Drafter, *, draft_tokens: int | None, policy: AdaptivePolicy | None,
                 stats: SpeculativeStats):
        self.drafter, self.draft_tokens, self.policy, self.stats = drafter, draft_tokens, policy, stats
        self.accepted = 0  # drafted tokens the last verification kept

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

    def verify(self, emit: "Emitter", rows: torch.Tensor, k: int, draft: list[int], *, room: int,
               started: float, step_s: float | None = None) -> Iterator[TokenEvent]:
        """`emit.take`'s tokens, recorded: the step is timed from `started` to its first row's choice,
        read on the host where a plain step's time ends too (or `step_s`, measured by the caller)."""
        st, events, self.accepted = self.stats, emit.take(rows, draft, room=room), 0
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

    def begin(self, engine, sampling: SamplingParams) -> None:
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
