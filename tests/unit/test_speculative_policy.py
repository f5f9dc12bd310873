"""The adaptive draft-length policy against a fake clock and fake acceptance, the n-gram drafter,
and the hot-vocabulary head as a function of hidden rows and the head's weights."""
import math
import random
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from moestream.engine.hot_head import HotHead, hot_vocabulary, usable
from moestream.engine.draft_choice import parse_draft
from moestream.engine.draft_policy import AdaptivePolicy
from moestream.engine.speculative import Drafter, NGramDrafter
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError


def simulate(policy, step_cost, accept, steps=400, seed=0):
    """Run the policy against a fake clock (step_cost(T) seconds) and drafts each kept with
    probability `accept`; the draft lengths it chose over the second half."""
    rng = random.Random(seed)
    chosen = []
    for i in range(steps):
        k = policy.choose()
        policy.record_draft(k, 0.0)
        policy.record_step(k + 1, step_cost(k + 1))
        kept = 0
        while kept < k and rng.random() < accept:
            kept += 1
        policy.record_accept(k, kept)
        if i >= steps // 2:
            chosen.append(k)
    return Counter(chosen)


def test_expected_tokens():
    assert AdaptivePolicy.expected_tokens(0.0, 5) == 1.0
    assert AdaptivePolicy.expected_tokens(1.0, 5) == 6.0
    assert AdaptivePolicy.expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_no_acceptance_means_plain_steps():
    policy = AdaptivePolicy(8, probe_every=16)
    chosen = simulate(policy, lambda T: 0.01, accept=0.0)
    assert chosen[0] >= 0.9 * sum(chosen.values())  # all but the occasional one-token probe
    assert set(chosen) <= {0, 1}
    assert chosen[1] <= 2  # probes back off (below)


def probe_steps(policy, step_cost, steps=1000):
    """The verifications at which a policy drafts, every draft rejected, on a fake clock."""
    probes = []
    for i in range(steps):
        k = policy.choose()
        policy.record_step(k + 1, step_cost(k + 1))
        policy.record_accept(k, 0)
        if k:
            probes.append(i)
    return probes


def test_probes_of_a_failing_drafter_back_off():
    # a cheap probe (a quarter of a plain step more: 2 % of the time allows one every 13 steps): step 1
    # tries one drafted token (step(2) unmeasured), step 2 two (a_2 is still the prior), then probes
    # follow after 16, 32, 64, 128, 256, 256 plain steps
    cheap = probe_steps(AdaptivePolicy(4, probe_every=16), lambda T: 0.01 if T == 1 else 0.0125)
    assert cheap == [1, 2, 18, 50, 114, 242, 498, 754]
    # each probe a plain step dearer: at most 2 % of the time goes to probes, so 50 plain steps between
    # them at least, more as they back off
    assert probe_steps(AdaptivePolicy(4, probe_every=16), lambda T: 0.01 * T) == [1, 51, 101, 165, 293, 549, 805]


def test_a_kept_policy_probes_each_new_generation_at_its_price():
    """The server keeps one policy across requests: after a request where drafting never paid, the next
    request's first probe comes after `probe_every` plain steps where probes are cheap, and where they
    are dear only once a probe is worth PROBE_SHARE of the plain steps before it (not at once again)."""
    cheap = AdaptivePolicy(4, probe_every=16)
    cheap.begin()
    probe_steps(cheap, lambda T: 0.01 * (1 + 0.01 * (T - 1)), steps=600)
    cheap.begin()
    assert probe_steps(cheap, lambda T: 0.01 * (1 + 0.01 * (T - 1)), steps=40)[:1] == [15]  # its 16th choice
    dear = AdaptivePolicy(4, probe_every=16)
    dear.begin()
    first = probe_steps(dear, lambda T: 0.01 * T ** 3, steps=600)  # dear probes: spaced by their cost
    assert len(first) >= 2 and first[-1] - first[-2] > 100
    dear.begin()
    again = probe_steps(dear, lambda T: 0.01 * T ** 3, steps=600)
    assert again and again[0] > 100  # priced (0.07 s against 0.2 ms of 2 % of a plain step: ~350 steps)


def test_a_drafters_own_price_spaces_the_first_probe():
    """Before any probe was paid, a drafter that knows its catch-up is dear (a draft engine's prefill)
    prices its first draft and probe; a drafter with no price (n-gram) tries one at once."""
    priced, unpriced = AdaptivePolicy(4, probe_every=16), AdaptivePolicy(4, probe_every=16)
    for policy, price in ((priced, 0.02), (unpriced, 0.0)):
        policy.begin()
        policy.probe_s = price
    step = lambda T: 0.01 * (1 + 0.01 * (T - 1))  # noqa: E731
    assert probe_steps(unpriced, step, steps=100)[:1] == [1]  # the first try, once step(1) is known
    assert not probe_steps(priced, step, steps=90)  # 0.02 s / (2 % of 10 ms) = 100 plain steps first


def test_high_acceptance_and_flat_cost_drafts_the_most():
    policy = AdaptivePolicy(8)
    chosen = simulate(policy, lambda T: 0.01, accept=0.97)
    assert chosen.most_common(1)[0][0] == 8


def test_noise_never_makes_a_longer_step_look_cheaper():
    """A loaded machine: step(2) measured below step(1) by noise. A longer step is costed at least
    as a shorter one, so a low acceptance keeps plain steps."""
    policy = AdaptivePolicy(1, probe_every=1000)
    policy.record_step(1, 0.050)
    policy.record_step(2, 0.036)  # noise
    policy.record_draft(1, 0.002)
    for _ in range(40):  # a drafter that is almost never right
        policy.record_accept(1, 0)
    assert estimated_step(policy, 2) == 0.050 and estimated_step(policy, 5) == 0.050
    assert policy.choose() == 0


def test_lengths_are_explored_one_longer_at_a_time():
    """A drafter that is never right: its first draft is one token, and no draft grows past two."""
    policy = AdaptivePolicy(8)
    chosen = []
    for _ in range(60):
        k = policy.choose()
        chosen.append(k)
        policy.record_draft(k, 0.001 * k)
        policy.record_step(k + 1, 0.01 * (1 + 0.5 * k))
        policy.record_accept(k, 0)
    assert chosen[0] == 0 and chosen[1] == 1 and max(chosen) <= 2


def test_cost_growing_with_tokens_is_learned():
    # a = 0.8, step(T) = 1 + 0.25 (T - 1): E(k)/cost peaks at k = 3 (1.687) next to k = 4 (1.680)
    policy = AdaptivePolicy(8)
    chosen = simulate(policy, lambda T: 1.0 + 0.25 * (T - 1), accept=0.8, steps=600)
    assert chosen.most_common(1)[0][0] in (2, 3, 4, 5)
    assert chosen[8] == 0 and chosen[0] == 0
    # the same acceptance with steep cost (every extra token costs a whole step): plain wins
    steep = simulate(AdaptivePolicy(8), lambda T: float(T), accept=0.8)
    assert steep.most_common(1)[0][0] == 0


def test_policy_recovers_when_text_starts_repeating():
    policy = AdaptivePolicy(6, probe_every=8)
    simulate(policy, lambda T: 0.01, accept=0.0, steps=100)
    chosen = simulate(policy, lambda T: 0.01, accept=0.98, steps=200)
    assert chosen.most_common(1)[0][0] == 6


def test_policy_respects_the_limit():
    policy = AdaptivePolicy(8)
    for T in range(1, 10):
        policy.record_step(T, 0.01)
    policy.record_accept(8, 8)
    assert policy.choose(limit=3) == 3
    assert policy.choose(limit=0) == 0


def test_ngram_drafter_proposes_what_followed_the_latest_match():
    d = NGramDrafter(max_ngram=3)
    ctx = [1, 2, 3, 4, 5, 9, 1, 2, 3, 4, 6, 7, 2, 3]
    assert d.propose(ctx, 4) == [4, 6, 7, 2]  # latest "2 3" is followed by 4 6 7 2 (longest match tried first)
    assert d.propose(ctx, 0) == []
    assert d.propose([1, 2, 3], 4) == []  # nothing repeats
    assert NGramDrafter(max_ngram=3, min_ngram=3).propose([5, 1, 2, 8, 1, 2], 2) == []  # only a 2-gram repeats
    assert NGramDrafter(max_ngram=3, min_ngram=2).propose([5, 1, 2, 8, 1, 2], 2) == [8, 1]
    with pytest.raises(MoestreamError):
        NGramDrafter(max_ngram=1, min_ngram=2)


def test_parse_draft():
    assert parse_draft("ngram") == ("ngram", None)
    assert parse_draft("off") == ("off", None)
    assert parse_draft("auto") == ("auto", None)
    assert parse_draft("draft:/m/d") == ("draft", "/m/d")  # the older spelling
    assert parse_draft("/m/d") == ("draft", "/m/d")
    for bad in ("draft:", ""):
        with pytest.raises(MoestreamError):
            parse_draft(bad)


def test_hot_head_guesses_the_full_argmax_when_it_is_hot():
    torch.manual_seed(0)
    V, H = 500, 32
    lm_head, norm = torch.randn(V, H), torch.rand(H) + 0.5
    hidden = torch.randn(6, H)
    full = torch.nn.functional.linear(hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6) * norm,
                                      lm_head).argmax(-1).tolist()
    everything = HotHead(norm, lm_head, 1e-6, torch.arange(V))
    assert everything.guess(hidden) == full
    some = torch.tensor(sorted(set(full) | {3, 4, 5}))
    assert HotHead(norm, lm_head, 1e-6, some).guess(hidden) == full
    none = torch.tensor([t for t in range(V) if t not in full][:20])
    guesses = HotHead(norm, lm_head, 1e-6, none).guess(hidden)
    assert all(g in none.tolist() for g in guesses) and guesses != full


def test_hot_vocabulary_and_settings():
    ids = hot_vocabulary([7, 7, 7, 9, 9, 400, 1000], 500, prompt_tokens=2, base_tokens=4).tolist()
    assert ids == [0, 1, 2, 3, 7, 9]  # the two most frequent prompt tokens, ids below 4; 1000 is no token
    assert usable(SamplingParams()) is None
    assert usable(SamplingParams(temperature=0.5)) is not None
    assert usable(SamplingParams(repetition_penalty=1.2)) is not None


def test_acceptance_per_position_favours_long_drafts_for_copies():
    # prompt lookup: the first token is a coin flip (a match or not), a match then copies a long run
    policy = AdaptivePolicy(8)
    for _ in range(50):
        policy.record_accept(8, 0)
        policy.record_accept(8, 8)
    assert policy.acceptance_at(0) == pytest.approx(0.5, abs=0.05)
    assert policy.acceptance_at(5) > 0.9
    assert expected(policy, 8) > 4.0  # geometric with a = 0.5 would give under 2
    for T in range(1, 10):
        policy.record_step(T, 1.0 + 0.1 * (T - 1))
    assert policy.choose() == 8


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now


class ClockedEngine:
    """An engine whose step of T tokens takes step_s(T) on a fake clock; its choice at position p is
    (7 p) mod V, so the text is known in advance."""

    max_context = 4096
    tokenizer = SimpleNamespace(eos_token_ids=set())
    device = torch.device("cpu")
    hidden_tap = None
    V = 50

    def __init__(self, clock, step_s):
        self.clock, self.step_s, self.length = clock, step_s, 0

    def rows(self, positions):
        out = torch.zeros(len(positions), self.V)
        for i, p in enumerate(positions):
            out[i, (7 * p) % self.V] = 1.0
        return out

    def step(self, tokens):
        self.clock.now += self.step_s(len(tokens))
        self.length += len(tokens)
        return self.rows(range(self.length - len(tokens) + 1, self.length + 1))

    def step_unread(self, token):  # plain greedy stretches queue each step before reading its token
        return self.step([int(token)])

    def name_token(self, position, token):
        pass

    def rollback(self, length):
        self.length = length

    def _sync(self):
        pass


class WrongDrafter(Drafter):
    """Never agrees with ClockedEngine. Costs like a draft model's engine: each call reads the tokens
    it has not seen (read_s each, in one batch) after a fixed call_s."""

    def __init__(self, clock, call_s, read_s):
        self.clock, self.call_s, self.read_s, self.seen, self.calls = clock, call_s, read_s, 0, 0

    def propose(self, context, k):
        self.calls += 1
        self.clock.now += self.call_s + self.read_s * (len(context) - self.seen)
        self.seen = len(context)
        return [(7 * (len(context) + i) + 1) % ClockedEngine.V for i in range(k)]


def test_a_drafter_that_never_agrees_costs_about_plain_time(monkeypatch):
    """200 tokens with a drafter that is never right and dear (a call costs 1.5 plain steps, reading
    a token a hundredth of one): the policy drafts on two verifications (the first try and one priced
    probe), the tokens are plain decoding's, and the run takes under 3 % more than plain steps would."""
    from moestream.engine import decode_loop, speculative
    from moestream.engine.emitter import Emitter

    clock = FakeClock()
    monkeypatch.setattr(speculative, "time", clock)
    monkeypatch.setattr(decode_loop, "time", clock)
    step_s = 0.010
    engine = ClockedEngine(clock, lambda T: step_s * (1 + 0.5 * (T - 1)))
    drafter = WrongDrafter(clock, call_s=0.015, read_s=0.0001)
    prompt = list(range(32))
    engine.length = len(prompt)
    emit = Emitter(list(prompt), {"tokens": [], "finish": "length"}, sampling=SamplingParams(), logprobs=0,
                   eos_ids=set(), should_stop=None, stop_at_eos=False)
    speculation = speculative.SpeculativeOptions(drafter=drafter).for_generation()
    speculation.begin(engine, SamplingParams())
    first = engine.rows([len(prompt)])
    tokens = [e.token_id for e in decode_loop.decode(engine, emit, first, 200, speculation=speculation)]
    assert tokens == [(7 * p) % ClockedEngine.V for p in range(len(prompt), len(prompt) + 200)]
    assert drafter.calls <= 2
    assert clock.now <= 1.03 * 199 * step_s


def expected(policy: AdaptivePolicy, k: int) -> float:
    """E(k) from the policy's per-position acceptance estimates."""
    total, run = 1.0, 1.0
    for i in range(k):
        run *= policy.acceptance_at(i)
        total += run
    return total


def estimated_step(policy: AdaptivePolicy, tokens: int) -> float:
    """step(tokens) as the policy costs it: never below a shorter step's cost."""
    known = [c for t, c in policy.step_cost.items() if t <= tokens]
    return max(known) if known else 0.0


def estimated_rate(policy: AdaptivePolicy, k: int) -> float:
    """Expected tokens per second of drafting k (inf for a cost not yet known to be > 0)."""
    cost = estimated_step(policy, k + 1) + policy.draft_cost.get(k, 0.0) + (policy._catch_up() if k else 0.0)
    return math.inf if cost <= 0 else expected(policy, k) / cost


def test_the_choice_is_the_best_estimated_rate():
    """choose's one pass gives the k of the highest estimated_rate (ties to the shorter, plain kept
    unless a draft gains min_gain)."""
    rng = random.Random(1)
    for _ in range(200):
        policy = AdaptivePolicy(6, probe_every=10 ** 6)
        for T in range(1, rng.randint(1, 8)):
            policy.record_step(T, rng.uniform(0.005, 0.02))
        for k in range(1, 7):
            if rng.random() < 0.5:
                policy.draft_cost[k] = rng.uniform(0.0, 0.01)
        for _ in range(rng.randint(0, 30)):
            k = rng.randint(1, 6)
            policy.record_accept(k, rng.randint(0, k))
        top = min(6, max(policy.step_cost, default=0))
        rates = [estimated_rate(policy, k) * (1.0 + policy.min_gain if k == 0 else 1.0) for k in range(top + 1)]
        expected = max(range(top + 1), key=lambda k: (rates[k], -k)) if top else 0
        assert policy.choose() == expected


def test_a_plain_choice_says_how_many_plain_steps_follow_until_the_probe():
    """Plain steps teach the policy no acceptance, so after choosing 0 it knows how many plain steps
    in a row it will give; a caller that runs them at once (took_plain) meets the probe where one
    choose() per step would have."""
    def drive(at_once: bool) -> list[int]:
        policy = AdaptivePolicy(8, probe_every=16)
        chosen, step = [], 0
        while step < 600:
            k = policy.choose()
            if k == 0 and at_once and policy.plain_stretch() > 1:
                n = policy.plain_stretch()
                policy.took_plain(n, 0.01)
                chosen += [0] * n
                step += n
                continue
            policy.record_draft(k, 0.0)
            policy.record_step(k + 1, 0.01)
            policy.record_accept(k, 0)  # every draft rejected
            chosen.append(k)
            step += 1
        return chosen[:600]

    one_by_one, at_once = drive(False), drive(True)
    assert at_once == one_by_one
    assert one_by_one.count(1) >= 3  # the probes, backing off
    policy = AdaptivePolicy(8, probe_every=16)
    assert policy.choose() == 0 and policy.plain_stretch() == 1  # nothing measured yet: one step
