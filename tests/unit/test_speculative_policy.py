"""The adaptive draft-length policy against a fake clock and fake acceptance, the n-gram drafter,
and the hot-vocabulary head as a function of hidden rows and the head's weights."""
import random
from collections import Counter

import pytest
import torch

from moestream.engine.hot_head import HotHead, hot_vocabulary, usable
from moestream.engine.draft_choice import parse_draft
from moestream.engine.speculative import AdaptivePolicy, NGramDrafter
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


def test_probes_of_a_failing_drafter_back_off():
    policy = AdaptivePolicy(4, probe_every=16)
    probes = []
    for i in range(1000):
        k = policy.choose()
        policy.record_step(k + 1, 0.01 * (1 + k))
        policy.record_accept(k, 0)
        if k:
            probes.append(i)
    # step 1 tries one drafted token (step(2) unmeasured), then probes after 16, 32, 64, 128, 256, 256 plain steps
    assert probes == [1, 17, 49, 113, 241, 497, 753]


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
    assert policy.estimated_step(2) == 0.050 and policy.estimated_step(5) == 0.050
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
    assert policy.expected(8) > 4.0  # geometric with a = 0.5 would give under 2
    for T in range(1, 10):
        policy.record_step(T, 1.0 + 0.1 * (T - 1))
    assert policy.choose() == 8
