"""--decode-ahead: plain greedy decoding that queues each step before the host reads its token gives
the tokens of one step at a time, stops where it stops, and leaves a cache the next prompt can use
(CPU, forced on: the same code path as CUDA's, where nothing overlaps)."""
import pytest
import torch

from moestream.engine import generation
from moestream.engine.engine import UNREAD, Engine
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams

PROMPT = "def fibonacci(n):\n    if n < 2:"
NEXT = "import os\nclass Thing:"


def load(packed, mode: str) -> Engine:
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, prefetch="none", cache_size="min",
                                                     decode_ahead=mode))


def run(engine: Engine, prompt: str, n: int, **kw):
    gen = engine.generate(engine.tokenizer.encode(prompt), max_new_tokens=n, **kw)
    tokens = [event.token_id for event in gen]
    return tokens, gen.result


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen3_next"])  # qwen3_next: recurrent layers' saved states
def test_decode_ahead_gives_the_tokens_of_one_step_at_a_time(family, tiny_packed_model, monkeypatch):
    packed = tiny_packed_model(family, "q4")
    calls = []
    original = generation._decode_ahead
    monkeypatch.setattr(generation, "_decode_ahead", lambda *a: calls.append(1) or original(*a))
    results = {}
    for mode in ("off", "on"):
        engine = load(packed, mode)
        first, result = run(engine, PROMPT, 40, stop_at_eos=False)
        second, _ = run(engine, NEXT, 25, stop_at_eos=False)  # after a prompt's cache: reused or truncated
        assert UNREAD not in engine.cache.tokens
        results[mode] = (first, result.finish_reason, second, list(engine.cache.tokens))
        engine.close()
    assert len(calls) == 2  # `on` took the ahead loop for both prompts, `off` never
    assert results["on"][:3] == results["off"][:3]
    assert len(results["on"][0]) == 40
    # the last token is never stepped (budget), so the caches end the same
    assert results["on"][3] == results["off"][3]


def test_a_stop_leaves_one_real_token_more_in_the_cache(tiny_packed_model, monkeypatch):
    packed = tiny_packed_model("qwen3_moe", "q4")
    plain = load(packed, "off")
    reference, _ = run(plain, PROMPT, 30, stop_at_eos=False)
    plain.close()
    eos = reference[6]
    first = reference.index(eos)  # the first time that token comes
    engine = load(packed, "on")
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


def test_only_plain_greedy_choices_without_logprobs_decode_ahead(tiny_packed_model):
    engine = load(tiny_packed_model("qwen3_moe", "q4"), "on")
    emit = engine.emitter(engine.tokenizer.encode(PROMPT), {"tokens": []}, sampling=SamplingParams())
    assert generation.decodes_ahead(engine, emit)
    for sampling, logprobs in ((SamplingParams(), 2), (SamplingParams(temperature=0.8, seed=1), 0),
                               (SamplingParams(repetition_penalty=1.2), 0)):
        emit = engine.emitter(engine.tokenizer.encode(PROMPT), {"tokens": []}, sampling=sampling, logprobs=logprobs)
        assert not generation.decodes_ahead(engine, emit)
    engine.options.decode_ahead = "auto"  # auto: CUDA only
    assert not generation.decodes_ahead(engine, engine.emitter([1, 2], {"tokens": []}, sampling=SamplingParams()))
    with pytest.raises(ValueError, match="one token id"):
        engine.step_unread(torch.tensor([1, 2]))
    engine.close()
