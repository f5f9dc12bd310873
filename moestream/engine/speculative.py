"""Speculative decoding: a drafter proposes k tokens, the model verifies them in one step.

One verification runs `engine.step([last] + draft)`: row i of its logits predicts the token after
draft[:i], and a token's logits are the same bits whatever the step's length, so choosing row i's
token (argmax, or the Gumbel-max draw keyed by (seed, position)) gives exactly the token plain
decoding chooses there. The loop keeps drafted tokens while they equal the model's own choice,
takes the model's token at the first difference (or the bonus token after the last draft) and
rolls the KV cache back over the rejected ones. The text is therefore plain `generate`'s text,
greedy or sampled with a seed; the drafter and the policy change only the speed.

How many tokens to draft is a choice (`draft_tokens`) or the AdaptivePolicy's (moestream.engine.draft_policy)."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from moestream.engine.sampling import choose_token
from moestream.engine.draft_policy import AdaptivePolicy
from moestream.engine.emitter import Emitter
from moestream.engine.generation import plain_tokens
from moestream.engine.types import SamplingParams, TokenEvent
from moestream.errors import MoestreamError

log = logging.getLogger(__name__)


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
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens (n from
    `max_ngram` down to `min_ngram`) and propose what followed it. No model; strong wherever the
    text repeats itself (code, edits, quoting the prompt)."""

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
    """A drafter that scores tokens with a model of its own and chooses as the main model would:
    greedily, or with the main sampler's seed and temperature (the same Gumbel-max draw at the same
    position), so that a draft matches the main model's choice when their scores agree."""

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
    """A small model that shares the main model's tokenizer, run as its own Engine (its own KV
    cache). Each proposal brings its cache to the context (the engine's prefill reuses the common
    prefix, which is the rollback after rejected drafts) and drafts as ModelDrafter chooses. Between
    proposals it runs nothing: the tokens of plain steps are read in one prefill when it next drafts
    (the policy counts that catch-up in a probe's cost)."""

    name = "draft"

    def __init__(self, engine):
        super().__init__()
        self.engine = engine
        self._price: float | None = None

    @property
    def probe_price_s(self) -> float:
        """A probe after plain steps first reads the tokens this engine has not seen, one prefill: timed
        once (a catch-up of PRICE_TOKENS tokens, the second of two: the first compiles), the engine
        left empty. On a fast GPU that prefill costs more than a run of plain steps (the demo model on
        the H200: ~10 ms against 0.23 ms a token), which the policy must know before its first probe."""
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
    (draft_tokens None) drafting at most max_draft_tokens. hot_head: greedy decoding through the
    hot-vocabulary head instead (moestream.engine.hot_head; greedy only)."""

    drafter: Drafter | None = None
    draft_tokens: int | None = None
    max_draft_tokens: int = 8
    hot_head: object | None = None  # a hot_head.HotHeadOptions
    policy: AdaptivePolicy | None = field(default=None, repr=False)  # kept across generations

    def __post_init__(self):
        if self.draft_tokens is not None and self.draft_tokens < 0:
            raise MoestreamError(f"draft tokens must be >= 0, not {self.draft_tokens}")
        if self.max_draft_tokens < 1:
            raise MoestreamError(f"the most draft tokens must be >= 1, not {self.max_draft_tokens}")
        if self.drafter is not None and self.draft_tokens is None and self.policy is None:
            self.policy = AdaptivePolicy(self.max_draft_tokens)

    def for_one_sequence(self) -> tuple["SpeculativeStats", "AdaptivePolicy | None"]:
        """A new stats record and policy for one sequence of a batch (each learns its own acceptance)."""
        policy = None if self.draft_tokens is not None else AdaptivePolicy(self.max_draft_tokens)
        mode = "auto" if self.draft_tokens is None else str(self.draft_tokens)
        return SpeculativeStats(self.drafter.name, mode, policy=policy), policy

    def not_used_reason(self, sampling: SamplingParams) -> str | None:
        """Why these options cannot decode with `sampling` (None: they can). Drafters verify through
        the same Emitter as plain decoding, penalties, grammar and logit bias included, so they
        serve every setting; the hot head decodes greedily only."""
        if self.hot_head is not None:
            from moestream.engine.hot_head import usable

            return usable(sampling)
        return None


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
        """One verification: the length the policy (or the fixed setting) chose, the drafter's
        proposal (it may propose fewer), the tokens kept, the step's time."""
        if len(self.steps) < MAX_STEP_RECORDS:
            self.steps.append([chosen, drafted, accepted, round(verify_s * 1000.0, 3)])

    def plain_stretch(self, steps: int, seconds: float) -> None:
        """`steps` plain steps run as plain decoding (one verification of 0 drafted tokens each, at the
        stretch's mean time)."""
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


def run(engine, seq: list[int], logits: torch.Tensor, *, budget: int, sampling: SamplingParams, logprobs: int,
        should_stop, stop_at_eos: bool, options: SpeculativeOptions, state: dict) -> Iterator[TokenEvent]:
    """The decode loop of Engine.generate with speculation (after the prefill whose last logits
    are `logits`); fills state["tokens"], state["finish"] and state["speculative"] (the receipt's
    fields) like the plain loop does."""
    if options.hot_head is not None:
        from moestream.engine.hot_head import run_hot_head

        yield from run_hot_head(engine, seq, logits, budget=budget, sampling=sampling, logprobs=logprobs,
                                should_stop=should_stop, stop_at_eos=stop_at_eos, options=options.hot_head,
                                state=state)
        return
    if options.drafter is None:
        raise MoestreamError("speculative decoding needs a drafter")

    drafter, policy = options.drafter, options.policy
    stats = SpeculativeStats(drafter.name, "auto" if options.draft_tokens is None else str(options.draft_tokens),
                             policy=policy)
    state["speculative"] = stats
    drafter.begin(sampling)
    if policy is not None:
        policy.begin()
        if policy.probe_s <= 0:  # no probe paid yet: the drafter's own estimate prices the first
            policy.probe_s = drafter.probe_price_s
    for e in (engine, getattr(drafter, "engine", None)):  # no graph capture inside a timed step
        warm = getattr(e, "warm_steps", None)
        if warm is not None:
            warm((policy.max_draft if policy is not None else options.draft_tokens) + 1)
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
        # the cache holds seq[:-1]; seq[-1] is the next token to run
        limit = min(budget - produced - 1, engine.max_context - len(seq))
        k = min(options.draft_tokens, limit) if policy is None else policy.choose(limit)
        if k == 0 and limit > 0:  # plain steps until the policy's next probe: plain decoding (ahead where it may)
            n = limit + 1 if policy is None else min(limit + 1, policy.plain_stretch())
            if n > 1:
                t0, got = time.perf_counter(), 0
                for event in plain_tokens(engine, emit, engine.step([seq[-1]]), n):
                    got += 1
                    produced += 1
                    yield event
                if got < n:  # a stop
                    return
                seconds = time.perf_counter() - t0
                stats.plain_stretch(n, seconds)
                if policy is not None:
                    policy.took_plain(n, seconds / n)
                continue
        t0 = time.perf_counter()
        draft = drafter.propose(seq, k)[:k] if k > 0 else []
        t1 = time.perf_counter()
        rows = engine.step([seq[-1]] + draft)
        # the step is timed to its first row's choice, read on the host, where a plain step's time ends
        # too (a wait of its own would add a round trip to the device to every step); greedy reads
        # every row's choice at once
        chosen = emit.choices(rows[:len(draft) + 1]) if draft else None
        event = emit(rows[0], None if chosen is None else chosen[0])
        t2 = time.perf_counter()
        stats.verify_steps += 1
        stats.drafted += len(draft)
        stats.draft_s += t1 - t0
        stats.verify_s += t2 - t1
        stats.draft_lengths[len(draft)] = stats.draft_lengths.get(len(draft), 0) + 1
        if policy is not None:
            policy.record_draft(k, t1 - t0)
            policy.record_step(len(draft) + 1, t2 - t1)
        accepted = 0
        for i in range(len(draft) + 1):
            if i:
                event = emit(rows[i], None if chosen is None else chosen[i])
            if event is None:
                return
            produced += 1
            stats.step_tokens += 1
            yield event
            if i == len(draft) or event.token_id != draft[i]:
                break
            accepted += 1
            if produced >= budget:
                break
        stats.accepted += accepted
        stats.record(k, len(draft), accepted, t2 - t1)
        drafter.observe(len(draft), accepted)
        if policy is not None:
            policy.record_accept(len(draft), accepted)
        if accepted < len(draft):
            engine.rollback(len(seq) - 1)  # forget the rejected drafts
