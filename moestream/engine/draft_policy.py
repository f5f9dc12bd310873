"""The adaptive draft-length policy of speculative decoding: how many tokens to draft next (0 = a
plain step), from measured step costs by length, the drafter's cost and a running acceptance
estimate; when a failing drafter is probed again, and at what price."""
from __future__ import annotations

import math

MAX_PROBE_GAP = 256  # most plain steps between two probes of a drafter that keeps failing, while probes are cheap
PROBE_SHARE = 0.02  # the most of plain decoding's time that the probes of a failing drafter may take
MAX_PRICED_GAP = 4096  # ... unless that would space them further than this (a probe dearer than 82 plain steps)


class AdaptivePolicy:
    """How many tokens to draft next, from measurements, to maximize expected tokens per second.

    The i-th drafted token is kept, given the ones before it were, with probability a_i, so k drafted
    tokens yield E(k) = 1 + a_1 + a_1 a_2 + ... + a_1 ... a_k tokens for step(k + 1) + draft(k)
    seconds. An a per position matters for prompt lookup, whose drafts are all wrong (no match) or
    right for a long run (a copy). The policy picks the k in 0..max_draft with the most E(k) / cost(k);
    k = 0, a plain step, is kept unless drafting gains more than `min_gain` (5 %: timing noise).

    step(T) is an exponential moving average per T (with MoE each extra token may route to other
    experts: only measurement tells its cost), costed at no less than a shorter step's; a length is
    tried only once the one before it is measured, so a drafter that is seldom right costs one short
    try. Each a_i is a ratio of decayed counts (kept, tried) with a prior of `prior_accept` weighing
    `prior_weight` tokens. draft(k) is measured on drafts that follow a drafted verification: the
    first draft after plain steps also pays for the drafter's catching up (a draft engine's prefill).

    While plain steps win, a probe of one drafted token keeps a_1 current. Probes are priced: what the
    last draft after plain steps cost beyond the plain steps of its tokens (before any, the drafter's
    own `probe_price_s`) spaces the next probe so that probes take at most PROBE_SHARE of the plain
    steps' time, and each probe that does not turn drafting back on doubles the gap (from
    `probe_every`, up to MAX_PROBE_GAP where probes cost nothing)."""

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
        """A generation starts: its first draft pays for reading the prompt, and the probe schedule
        starts again (a kept policy still tries each new text once)."""
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

    def _catch_up(self) -> float:
        """What drafting now costs besides the draft and the step: after plain steps the drafter's
        catching up, priced as the last probe was; after a drafted verification nothing."""
        return 0.0 if self._in_step else self.probe_s

    def _best(self, top: int) -> int:
        """The k in 0..top with the most expected tokens per second, E(k) / cost(k), in one pass."""
        steps = self.step_cost
        step = steps.get(1, 0.0)
        if step <= 0:  # a plain step's rate not known to be finite: nothing beats it
            return 0
        best, best_rate = 0, (1.0 + self.min_gain) / step
        tokens, run, catch = 1.0, 1.0, self._catch_up()
        for k in range(1, top + 1):  # ties keep the shorter draft
            run *= self.acceptance_at(k - 1)
            tokens += run
            # never below a shorter step's cost: on a loaded machine a noisy average can make step(2)
            # look cheaper than step(1), which would start drafting that cannot pay
            step = max(step, steps.get(k + 1, 0.0))
            rate = tokens / (step + self.draft_cost.get(k, 0.0) + catch)
            if rate > best_rate:
                best, best_rate = k, rate
        return best

    def _gap(self) -> int:
        """Plain steps before the next probe: the backed-off gap, or more where probes are dear (a
        generation's first too, once a price is known)."""
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
