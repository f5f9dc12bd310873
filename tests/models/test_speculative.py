"""Speculative decoding gives plain generate's tokens, greedy and sampled with a seed, for every
drafter and draft length, on the tiny families and the demo model (CPU)."""
import random

import pytest
import torch

from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.engine.hot_head import DRAFT_TOKENS, HotHeadDrafter
from moestream.engine.options import EngineOptions
from moestream.engine.draft_choice import make_options
from moestream.engine.speculative import DraftModelDrafter, Drafter, NGramDrafter, SpeculativeOptions
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
PROMPTS = ["def fibonacci(n):\n    if n < 2:", "import os\nimport sys\nclass Thing:\n    def __init__(self):",
           "The quick brown fox"]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, seed=1234)


def load(packed, **opts):
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)


def run(engine, prompt, n, sampling=SamplingParams(), speculative=None, logprobs=0):
    engine.reset()  # a prefill of the whole prompt each time (a reused prefix computes the last row alone)
    gen = engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop_at_eos=False, logprobs=logprobs,
                          speculative=speculative)
    events = list(gen)
    return [e.token_id for e in events], events, gen.result


class Oracle(Drafter):
    """Knows the plain output; drafts it, wrong from `wrong_at` on (to reach every branch)."""

    name = "oracle"

    def __init__(self, prompt, plain, wrong_at=None, vocab=300):
        self.full, self.start, self.wrong_at, self.vocab = list(prompt) + list(plain), len(prompt), wrong_at, vocab

    def propose(self, context, k):
        out = self.full[len(context):len(context) + k]
        if self.wrong_at is not None and len(out) > self.wrong_at:
            out[self.wrong_at] = (out[self.wrong_at] + 1) % self.vocab
        return out


class RandomDrafter(Drafter):
    name = "random"

    def __init__(self, vocab):
        self.rng, self.vocab = random.Random(0), vocab

    def propose(self, context, k):
        return [self.rng.randrange(self.vocab) for _ in range(k)]


@pytest.mark.parametrize("family", FAMILIES)
def test_ngram_speculation_equals_plain_greedy_and_sampled(family, tiny_packed_model):
    engine = load(tiny_packed_model(family, "q4"), cache_size="min")
    drafted = accepted = 0
    for prompt_text in PROMPTS:
        prompt = engine.tokenizer.encode(prompt_text)
        for sampling in (SamplingParams(), SAMPLED):
            plain, plain_events, _ = run(engine, prompt, 40, sampling, logprobs=2)
            for k in (1, 3, None):
                spec = SpeculativeOptions(drafter=NGramDrafter(max_ngram=2), draft_tokens=k, max_draft_tokens=5)
                out, events, result = run(engine, prompt, 40, sampling, spec, logprobs=2)
                assert out == plain, (prompt_text, sampling, k)
                assert [e.top_logprobs for e in events] == [e.top_logprobs for e in plain_events]
                receipt = result.receipt["speculative"]
                assert receipt["drafter"] == "ngram" and receipt["draft_tokens"] == ("auto" if k is None else str(k))
                drafted, accepted = drafted + receipt["drafted"], accepted + receipt["accepted"]
    assert drafted > 0 and accepted > 0  # verification really kept drafted tokens
    engine.close()


@pytest.mark.parametrize("wrong_at", [None, 0, 2])
@pytest.mark.parametrize("sampling", [SamplingParams(), SAMPLED], ids=["greedy", "sampled"])
def test_any_drafter_gives_the_plain_tokens(wrong_at, sampling, tiny_packed_model):
    engine = load(tiny_packed_model("qwen3_moe", "q4"))
    prompt = engine.tokenizer.encode(PROMPTS[0])
    plain, _, _ = run(engine, prompt, 30, sampling)
    spec = SpeculativeOptions(drafter=Oracle(prompt, plain, wrong_at), draft_tokens=4)
    out, _, result = run(engine, prompt, 30, sampling, spec)
    assert out == plain
    r = result.receipt["speculative"]
    if wrong_at is None:  # every draft kept: 4 drafts + the bonus token per step
        assert r["accepted"] == r["drafted"] > 0 and r["tokens_per_step"] > 4
    else:
        assert r["accepted"] < r["drafted"] and (r["accepted"] == 0) == (wrong_at == 0)
    random_out, _, result = run(engine, prompt, 30, sampling,
                                SpeculativeOptions(drafter=RandomDrafter(engine.args.vocab_size), draft_tokens=3))
    assert random_out == plain
    assert engine.cache.tokens[:len(prompt) + 29] == prompt + plain[:29]  # the rejected drafts are rolled back
    engine.close()


def test_budget_and_context_limits(tiny_packed_model):
    engine = load(tiny_packed_model("olmoe", "q4"), max_context=40)
    prompt = engine.tokenizer.encode(PROMPTS[1])
    for n in (1, 2, 5, 100):  # 100: the context ends the run
        plain, _, plain_result = run(engine, prompt, n)
        out, _, result = run(engine, prompt, n, speculative=SpeculativeOptions(
            drafter=Oracle(prompt, plain), draft_tokens=8))
        assert out == plain and result.finish_reason == plain_result.finish_reason
        assert len(out) == min(n, 40 - len(prompt))
    engine.close()


def test_draft_model_drafter(tiny_packed_model):
    main = tiny_packed_model("qwen3_moe", "q4")
    engine = load(main)
    same = DraftModelDrafter(load(main))  # the model drafts for itself
    other = DraftModelDrafter(load(tiny_packed_model("qwen3_moe", "q4", seed=5)))  # another model, same tokenizer
    for prompt_text in PROMPTS[:2]:
        prompt = engine.tokenizer.encode(prompt_text)
        for sampling in (SamplingParams(), SAMPLED):
            plain, _, _ = run(engine, prompt, 32, sampling)
            for drafter in (same, other):
                for k in (2, None):
                    out, _, result = run(engine, prompt, 32, sampling, SpeculativeOptions(drafter=drafter, draft_tokens=k))
                    assert out == plain
                    r = result.receipt["speculative"]
                    if drafter is same and k == 2:  # the same model draws the same tokens (same seed, positions)
                        assert r["accept_rate"] > 0.9
    assert same.engine.cache.length > 0
    same.close()
    other.close()
    engine.close()


def test_draft_model_must_share_the_vocabulary(tiny_packed_model):
    engine = load(tiny_packed_model("qwen3_moe", "q4"))
    with pytest.raises(MoestreamError, match="vocabulary"):
        make_options("draft", str(tiny_packed_model("qwen3_moe", "q4")), draft_tokens=2,
                     main_engine=type("E", (), {"args": type("A", (), {"vocab_size": 7})()})(),
                     engine_options=EngineOptions(device="cpu", threads=1))
    engine.close()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("base", [8, 4096])
def test_hot_head_equals_plain_greedy(family, base, tiny_packed_model):
    engine = load(tiny_packed_model(family, "q4"))
    for prompt_text in PROMPTS:
        prompt = engine.tokenizer.encode(prompt_text)
        plain, plain_events, _ = run(engine, prompt, 30, logprobs=3)
        hot = SpeculativeOptions(drafter=HotHeadDrafter(engine, prompt_tokens=4, base_tokens=base), draft_tokens=2)
        out, events, result = run(engine, prompt, 30, speculative=hot, logprobs=3)
        assert out == plain
        assert [e.top_logprobs for e in events] == [e.top_logprobs for e in plain_events]
        r = result.receipt["speculative"]
        if base >= engine.args.vocab_size:  # every token is hot: every guess is right
            assert r["accepted"] == r["drafted"] > 0
    engine.close()


def test_hot_head_redoes_wrong_guesses(tiny_packed_model):
    engine = load(tiny_packed_model("mixtral", "q4"))
    prompt = engine.tokenizer.encode(PROMPTS[0])
    plain, _, _ = run(engine, prompt, 40)
    out, _, result = run(engine, prompt, 40, speculative=SpeculativeOptions(
        drafter=HotHeadDrafter(engine, prompt_tokens=0, base_tokens=3), draft_tokens=3))
    assert out == plain
    assert result.receipt["speculative"]["accepted"] < result.receipt["speculative"]["drafted"]
    with pytest.raises(MoestreamError, match="greedily"):
        run(engine, prompt, 4, SAMPLED, SpeculativeOptions(drafter=HotHeadDrafter(engine), draft_tokens=DRAFT_TOKENS))
    engine.close()


@pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not in this checkout")
def test_demo_model_speculation_equals_plain():
    engine = Engine.load(options=EngineOptions(device="cpu", threads=1))
    prompt = engine.tokenizer.encode("class Vector:\n    def add(self, other):\n        return Vector(self.x + other.x)\n"
                                     "    def sub(self, other):\n")
    for sampling in (SamplingParams(), SamplingParams(temperature=0.7, top_p=0.9, seed=3)):
        plain, _, _ = run(engine, prompt, 48, sampling)
        for k in (2, None):
            out, _, result = run(engine, prompt, 48, sampling, SpeculativeOptions(drafter=NGramDrafter(), draft_tokens=k))
            assert out == plain
            assert result.receipt["speculative"]["accepted"] > 0
    plain, _, _ = run(engine, prompt, 32)
    out, _, _ = run(engine, prompt, 32, speculative=SpeculativeOptions(drafter=HotHeadDrafter(engine, base_tokens=512),
                                                                       draft_tokens=DRAFT_TOKENS))
    assert out == plain
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_step_hidden_then_head_rows_gives_the_step_logits(family, tiny_packed_model):
    """A step that stops before the head, then the head over the saved rows: step's bits and KV."""
    engine = load(tiny_packed_model(family, "q4"), cache_size="min")
    prompt = engine.tokenizer.encode(PROMPTS[0])
    tokens = [5, 17, 3, 99, 42, 7]
    engine.reset()
    engine.prefill(prompt)
    logits = engine.step(tokens)  # [T, V]
    step_cache = list(engine.cache.tokens)
    engine.rollback(len(prompt))
    hidden = engine.step_hidden(tokens)
    assert hidden.shape == (len(tokens), engine.args.hidden_size) and engine.cache.tokens == step_cache
    assert torch.equal(engine.head_rows(hidden), logits)
    engine.rollback(len(prompt))
    singles = torch.cat([engine.step_hidden([t]) for t in tokens])  # one token a step, as the hot head runs
    assert torch.equal(singles, hidden)
    assert torch.equal(engine.head_rows(singles[2:5]), logits[2:5])
    with pytest.raises(ValueError, match="rows"):
        engine.head_rows(torch.cat([hidden] * 3))
    engine.close()


@pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not in this checkout")
def test_demo_model_hot_head_over_200_tokens_bit_for_bit():
    engine = Engine.load(options=EngineOptions(device="cpu", threads=1))
    for text in ("def fibonacci(n):",):
        prompt = engine.tokenizer.encode(text)
        plain, plain_events, _ = run(engine, prompt, 220, logprobs=2)
        for options in (SpeculativeOptions(drafter=HotHeadDrafter(engine), draft_tokens=DRAFT_TOKENS),
                        SpeculativeOptions(drafter=HotHeadDrafter(engine, prompt_tokens=16, base_tokens=256),
                                           draft_tokens=5)):
            out, events, result = run(engine, prompt, 220, speculative=options, logprobs=2)
            assert out == plain and len(out) == 220
            assert [(e.logprob, e.top_logprobs) for e in events] == [(e.logprob, e.top_logprobs) for e in plain_events]
            r = result.receipt["speculative"]
            assert r["drafter"] == "hot-head" and 0 < r["accepted"] <= r["drafted"]
    engine.close()


class NeverDrafter(Drafter):
    """Always wrong (it proposes a token the plain run never gives): the policy turns drafting off
    and probes now and then."""

    name = "never"

    def __init__(self, never: int = 0):
        self.never = never

    def propose(self, context, k):
        return [self.never] * k


def test_plain_stretches_decode_ahead_and_give_the_plain_tokens(tiny_packed_model):
    """While the policy chooses plain steps, the loop runs them as plain decoding (greedy: ahead, on
    the CPU too): the plain tokens, and the stretches in the receipt."""
    engine = load(tiny_packed_model("qwen3_moe", "q4"))
    prompt = engine.tokenizer.encode(PROMPTS[2])
    plain, _, _ = run(engine, prompt, 120)
    unread = []
    step_unread = engine.step_unread
    engine.step_unread = lambda token, **kw: unread.append(1) or step_unread(token, **kw)
    never = min(set(range(len(plain) + 1)) - set(plain))
    out, _, result = run(engine, prompt, 120, speculative=SpeculativeOptions(drafter=NeverDrafter(never)))
    assert out == plain
    r = result.receipt["speculative"]
    # how many plain steps the policy takes between probes depends on measured times: only that
    # stretches ran, and ran ahead (step_unread), is certain
    assert r["plain_stretches"] >= 1 and r["draft_lengths"]["0"] >= 1 and len(unread) >= 1
    assert r["accepted"] == 0 and r["tokens_per_step"] == 1.0
    engine.close()
