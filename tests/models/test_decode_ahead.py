"""Plain greedy decoding queues each step before the host reads its token: it gives the tokens of one
step at a time (the loop's path where log-probabilities are read), stops where it stops, and leaves a
cache the next prompt can use (CPU: the same code path as CUDA's, where nothing overlaps)."""
import pytest
import torch

from moestream.engine import decode_loop
from moestream.engine.engine import UNREAD, Engine
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:"
NEXT = "import os\nclass Thing:"


def load(packed) -> Engine:
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, cache_size="min"), prefetch=False)


def run(engine: Engine, prompt: str, n: int, **kw):
    gen = engine.generate(engine.tokenizer.encode(prompt), max_new_tokens=n, **kw)
    tokens = [event.token_id for event in gen]
    return tokens, gen.result


@pytest.fixture
def ahead_calls(monkeypatch):
    calls = []
    original = decode_loop._ahead
    monkeypatch.setattr(decode_loop, "_ahead", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])  # qwen3_next: recurrent layers' saved states
def test_decode_ahead_gives_the_tokens_of_one_step_at_a_time(family, tiny_packed_model, ahead_calls):
    packed = tiny_packed_model(family, "q4")
    results = {}
    for logprobs in (1, 0):  # 1: the host reads each row (one step a token); 0: ahead
        engine = load(packed)
        first, result = run(engine, PROMPT, 40, stop_at_eos=False, logprobs=logprobs)
        second, _ = run(engine, NEXT, 25, stop_at_eos=False, logprobs=logprobs)  # after a prompt's cache
        assert UNREAD not in engine.cache.tokens
        results[logprobs] = (first, result.finish_reason, second, list(engine.cache.tokens))
        engine.close()
    assert len(ahead_calls) == 2  # greedy without logprobs took the ahead loop for both prompts, with them never
    assert results[0][:3] == results[1][:3]
    assert len(results[0][0]) == 40
    # the last token is never stepped (budget), so the caches end the same
    assert results[0][3] == results[1][3]


def test_a_stop_leaves_one_real_token_more_in_the_cache(tiny_packed_model, monkeypatch):
    packed = tiny_packed_model("qwen3_moe", "q4")
    plain = load(packed)
    reference, _ = run(plain, PROMPT, 30, stop_at_eos=False, logprobs=1)
    plain.close()
    eos = reference[6]
    first = reference.index(eos)  # the first time that token comes
    engine = load(packed)
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset({eos}))
    tokens, receipt = run(engine, PROMPT, 30)
    assert tokens == reference[:first] and receipt.finish_reason == "stop"
    prompt = engine.tokenizer.encode(PROMPT)
    # the end token was fed to the step queued before it was read: its K/V are those of a real token
    assert engine.cache.tokens == prompt + reference[:first + 1]
    got: list[int] = []
    gen = engine.generate(prompt, max_new_tokens=30, should_stop=lambda: len(got) >= 3)
    got.extend(event.token_id for event in gen)
    assert gen.result.finish_reason == "cancelled" and got == reference[:3]
    assert UNREAD not in engine.cache.tokens
    monkeypatch.setattr(engine.tokenizer, "eos_token_ids", frozenset())
    again, _ = run(engine, PROMPT, 30)  # the cached prefix (one token past the stop) is reused correctly
    assert again == reference
    engine.close()


def test_only_plain_greedy_choices_without_logprobs_decode_ahead(tiny_packed_model, ahead_calls):
    engine = load(tiny_packed_model("qwen3_moe", "q4"))
    run(engine, PROMPT, 3)
    assert len(ahead_calls) == 1
    for sampling, logprobs in ((SamplingParams(), 2), (SamplingParams(temperature=0.8, seed=1), 0),
                               (SamplingParams(repetition_penalty=1.2), 0)):
        run(engine, PROMPT, 3, sampling=sampling, logprobs=logprobs)
    assert len(ahead_calls) == 1
    with pytest.raises(ValueError, match="one token id"):
        engine.step_unread(torch.tensor([1, 2]))
    engine.close()
