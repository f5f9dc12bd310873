"""Speculative decoding: a drafter proposes k tokens, the model verifies them in one step.

One verification runs `engine.step([last] + draft)`: row i of its logits predicts the token after
draft[:i], and a token's logits are the same bits whatever the step's length, so choosing row i's
token (argmax, or the Gumbel-max draw keyed by (seed, position)) gives exactly the token plain
decoding chooses there. The loop keeps drafted tokens while they equal the model's own choice,
takes the model's token at the first difference (or the bonus token after the last draft) and
rolls the KV cache back over the rejected ones. The text is therefore plain `generate`'s text,
greedy or sampled with a seed; the drafter and the policy change only the speed.

How many tokens to draft is a choice (`draft_tokens`) or the AdaptivePolicy's (see there)."""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import torch

from moestream.engine.sampling import choose_token
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
MAX_PROBE_GAP = 256  # most plain steps between two probes of a drafter that keeps failing, while probes are cheap
PROBE_SHARE = 0.02  # the most of plain decoding's time that the probes of a failing drafter may take
MAX_PRICED_GAP = 4096  # ... unless that would space them further than this (a probe dearer than 82 plain steps)


class AdaptivePolicy:
    """How many tokens to draft next, from measurements, to maximize expected tokens per second.

    The model: the i-th drafted token (i = 1..k) is kept, given that the ones before it were, with
    probability a_i, so a verification of k drafted tokens yields
        E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k
    tokens (the kept run plus the model's own token) and costs step(k + 1) + draft(k) seconds. With
    one a for every position this is E(k) = (1 - a^(k+1)) / (1 - a); a per position matters for
    prompt lookup, whose drafts are all wrong (no match) or right for a long run (a copy), so a_1 is
    low and the later a_i high. The policy picks the k in 0..max_draft with the most E(k) / cost(k);
    k = 0 is a plain step, kept unless drafting is expected to gain more than `min_gain` (5 %:
    below timing noise).

    step(T) is measured online (an exponential moving average per T): with MoE every extra token
    may route to other experts, so its cost grows with T by an amount only measurement tells. A
    step is costed at no less than the largest cost measured for a shorter one (nothing assumed
    but that a longer step is not cheaper), and a length is tried only once the one before it is
    measured (k once step(k) is known), so lengths are explored one longer at a time and a drafter
    that is seldom right costs one short try. Each a_i is a ratio of decayed counts (kept,
    tried; decayed each time the position is verified) with a prior of `prior_accept` weighing
    `prior_weight` tokens. draft(k) is measured on drafts that follow a drafted verification: a
    drafter with a model of its own reads the tokens it has not seen when it next drafts (a draft
    engine's prefill of them), so the first draft after plain steps also pays for catching up.

    While plain steps win, a probe of one drafted token keeps a_1 current (text that starts
    repeating turns speculation back on). Probes are priced: what the last draft after plain steps
    cost beyond the plain steps of the tokens it gave (its drafter's catch-up, the longer step; before
    any, the drafter's own estimate, `Drafter.probe_price_s`) spaces the next probe so that probes take at most PROBE_SHARE of the plain steps' time, and
    each probe that does not turn drafting back on doubles the gap (from `probe_every`, up to
    MAX_PROBE_GAP where probes cost nothing). A drafter that never pays costs a few probes, about
    PROBE_SHARE of the run at most, and a plain step's decision is a few comparisons."""

    def __init__(self, max_draft: int = 8, *, smoothing: float = 0.25, accept_decay: float = 0.95,
                 prior_accept: float = 0.5, prior_weight: float = 1.0, probe_every: int = 16,
                 min_gain: float = 0.05):
        if max_draft < 0:
            raise ValueError("max_draft must be >= 0")
        self.max_draft, self.smoothing, self.accept_decay = max_draft, smoothing, accept_decay
        self.probe_every, self.min_gain = probe_every, min_gain
        self.prior_accept, self.prior_weight = prior_accept, prior_weight
        self.step_cost: dict[int, float] = {}  # T -> EMA seconds of step(T)
        self._steps_seen: dict[int, int] = {}  # T -> steps of T recorded
        self.draft_cost: dict[int, float] = {}  # k -> EMA seconds of proposing k tokens (drafter in step)
        self.kept = [0.0] * max_draft  # per draft position: decayed count of tokens kept there
        self.tried = [0.0] * max_draft  # ... and of tokens verified there (the ones before it all kept)
        self._plain_run = 0
        self._probe_gap = probe_every  # doubles after each probe that does not turn drafting on
        self._fresh = False  # no draft yet in this generation (begin): the next probe is not priced
        self.probe_s = 0.0  # what the last draft after plain steps cost beyond plain steps of its tokens
        self._chosen = 0  # the current verification's draft length
        self._in_step = False  # whether the verification before it drafted (the drafter then has little to read)
        self._draft_s = self._step_s = 0.0  # the current verification's measured times
        self._stretch = 1  # after choose gave 0: the plain steps in a row it gives, that one included

    def acceptance_at(self, i: int) -> float:
        """a_(i+1): the chance that draft position i (from 0) is kept, given all before it were."""
        w = self.prior_weight
        return (self.kept[i] + w * self.prior_accept) / (self.tried[i] + w)

    @property
    def acceptance(self) -> float:
        """The share of verified draft tokens that were kept (decayed), for receipts."""
        tried = sum(self.tried)
        return sum(self.kept) / tried if tried else self.prior_accept

    def expected(self, k: int) -> float:
        """E(k) from the per-position estimates."""
        total, run = 1.0, 1.0
        for i in range(k):
            run *= self.acceptance_at(i)
            total += run
        return total

    @staticmethod
    def expected_tokens(a: float, k: int) -> float:
        """E(k) for one acceptance a at every position: (1 - a^(k+1)) / (1 - a)."""
        if a >= 1.0:
            return k + 1.0
        return (1.0 - a ** (k + 1)) / (1.0 - a)

    def _ema(self, table: dict[int, float], key: int, seconds: float) -> None:
        old = table.get(key)
        table[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def begin(self) -> None:
        """A generation starts: its first draft pays for the drafter's reading of the prompt. The probe
        schedule starts again (the first probe after `probe_every` plain steps, whatever probes cost
        before): a kept policy still tries each new text once."""
        self._in_step, self._chosen = False, 0
        self._plain_run, self._probe_gap, self._fresh = 0, self.probe_every, True

    def record_step(self, tokens: int, seconds: float) -> None:
        # a length's first step may include its kernels' first use (compilation, a graph's capture):
        # the second replaces it rather than averaging with it
        seen = self._steps_seen.get(tokens, 0)
        self._steps_seen[tokens] = seen + 1
        if seen == 1:
            self.step_cost[tokens] = seconds
        else:
            self._ema(self.step_cost, tokens, seconds)
        self._step_s = seconds

    def record_draft(self, k: int, seconds: float) -> None:
        if k <= 0:
            return
        self._draft_s = seconds
        if self._in_step:  # else the draft paid for catching up over plain steps: the probe's cost
            self._ema(self.draft_cost, k, seconds)

    def record_accept(self, drafted: int, accepted: int) -> None:
        if self._chosen > 0 and not self._in_step:
            plain = self.step_cost.get(1, 0.0)
            self.probe_s = max(0.0, self._draft_s + self._step_s - (1 + accepted) * plain)
        self._in_step, self._chosen = self._chosen > 0, 0
        self._draft_s = self._step_s = 0.0
        if drafted <= 0:
            return
        d = self.accept_decay
        for i in range(min(accepted + 1, drafted, self.max_draft)):  # the positions verified
            self.tried[i] = d * self.tried[i] + 1.0
            self.kept[i] = d * self.kept[i] + (1.0 if i < accepted else 0.0)

    def estimated_step(self, tokens: int) -> float:
        """step(tokens), never below a shorter step's cost: on a loaded machine a noisy average can
        make step(2) look cheaper than step(1), which would start drafting that cannot pay."""
        known = [c for t, c in self.step_cost.items() if t <= tokens]
        return max(known) if known else 0.0

    def _catch_up(self) -> float:
        """What drafting now costs besides the draft and the step: after plain steps the drafter reads
        what it has not seen (a draft engine's prefill), priced as the last probe was (or the drafter's
        own estimate); after a drafted verification nothing."""
        return 0.0 if self._in_step else self.probe_s

    def estimated_rate(self, k: int) -> float:
        """Expected tokens per second of drafting k (inf for a cost not yet known to be > 0)."""
        cost = self.estimated_step(k + 1) + self.draft_cost.get(k, 0.0) + (self._catch_up() if k else 0.0)
        tokens = self.expected(k)
        return math.inf if cost <= 0 else tokens / cost

    def _best(self, top: int) -> int:
        """The k in 0..top with the most expected tokens per second (estimated_rate's, in one pass)."""
        steps = self.step_cost
        step = steps.get(1, 0.0)
        if step <= 0:  # a plain step's rate not known to be finite: nothing beats it
            return 0
        best, best_rate = 0, (1.0 + self.min_gain) / step
        tokens, run, catch = 1.0, 1.0, self._catch_up()
        for k in range(1, top + 1):  # ties keep the shorter draft
            run *= self.acceptance_at(k - 1)
            tokens += run
            step = max(step, steps.get(k + 1, 0.0))
            rate = tokens / (step + self.draft_cost.get(k, 0.0) + catch)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _gap(self) -> int:
        """Plain steps before the next probe: the backed-off gap, or more where probes are dear (a
        generation's first probe too, once a probe's price is known: a probe dearer than PROBE_SHARE of
        a generation's plain steps is not worth its chance)."""
        if self._fresh and self.probe_s <= 0:  # no price known yet: the first probe at the backed-off gap
            return self._probe_gap
        plain = self.step_cost.get(1, 0.0)
        priced = math.ceil(self.probe_s / (PROBE_SHARE * plain)) if plain > 0 else 0
        return max(self._probe_gap, min(priced, MAX_PRICED_GAP))

    def plain_stretch(self) -> int:
        """After choose() gave 0: how many plain steps in a row, that one included, it gives before its
        next probe (1 while it is still measuring), so that the caller can run them as plain decoding."""
        return self._stretch

    def took_plain(self, steps: int, seconds_per_token: float) -> None:
        """The caller ran plain_stretch()'s `steps` plain steps at once: they count toward the next probe,
        and their time per token (decoding ahead, no drafter between them) is what a plain step costs."""
        self._plain_run += steps - 1
        self._stretch = 1
        self.record_step(1, seconds_per_token)
        self.record_accept(0, 0)  # as after a plain verification: the next draft pays for catching up

    def choose(self, limit: int | None = None) -> int:
        """Draft length for the next verification, at most `limit` (room left in budget/context)."""
        top = self.max_draft if limit is None else max(0, min(self.max_draft, limit))
        # lengths are tried one longer at a time (k drafted only once step(k) is measured): a drafter
        # that is seldom right costs one short try, not a first draft of max_draft tokens
        top = min(top, max(self.step_cost, default=0))
        best = self._best(top)
        self._stretch = 1
        if best == 0 and top > 0:
            self._plain_run += 1
            if self._plain_run >= self._gap():
                self._plain_run, self._fresh = 0, False
                self._probe_gap = min(2 * self._probe_gap, MAX_PROBE_GAP)
                best = 1
            else:  # nothing but the probe changes a plain choice (plain steps teach it no acceptance)
                self._stretch = self._gap() - self._plain_run
        elif best > 0:
            self._plain_run, self._probe_gap, self._fresh = 0, self.probe_every, False
        self._chosen = best
        return best


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
