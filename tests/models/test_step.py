"""The step API: step(T tokens) gives the bits of T one-token steps, rollback forgets positions,
and generate is prefill + sampling + step, for every family (CPU)."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "gemma4_text", "gpt_oss",
            "qwen3_next", "qwen3_5_moe"]
PROMPT = "def fibonacci(n):\n    if n < 2:"


def load(packed, **opts):
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("quant", ["none", "q4"])
def test_step_of_t_tokens_equals_t_single_steps(family, quant, tiny_packed_model):
    engine = load(tiny_packed_model(family, quant), cache_size="min")  # batches: more experts than slots
    prompt = engine.tokenizer.encode(PROMPT)
    draft = [5, 17, 300, 42, 9, 250, 77]
    engine.prefill(prompt)
    together = engine.step(draft)
    assert together.shape == (len(draft), engine.args.vocab_size)
    engine.rollback(len(prompt))
    one_by_one = torch.cat([engine.step([t]) for t in draft])
    assert torch.equal(together, one_by_one)  # bit for bit, not within a tolerance
    assert engine.cache.tokens == prompt + draft
    engine.close()


def test_steps_longer_than_one_decoder_step_are_split(tiny_packed_model):
    from moestream.engine.decoder import MAX_STEP_TOKENS

    engine = load(tiny_packed_model("qwen3_moe", "q4"))
    prompt = engine.tokenizer.encode(PROMPT)
    tokens = [(7 * i + 3) % engine.args.vocab_size for i in range(MAX_STEP_TOKENS + 3)]
    engine.prefill(prompt)
    together = engine.step(tokens)
    engine.rollback(len(prompt))
    assert torch.equal(together, torch.cat([engine.step([t]) for t in tokens]))
    engine.close()


def test_rollback_then_the_same_tokens_give_the_same_logits(tiny_packed_model):
    engine = load(tiny_packed_model("qwen2_moe", "q4"), cache_size="min")
    prompt = engine.tokenizer.encode(PROMPT)
    engine.prefill(prompt)
    first = engine.step([11, 12, 13])
    engine.rollback(len(prompt) + 1)  # keep the first drafted token, reject the rest
    assert engine.cache.tokens == prompt + [11]
    again = engine.step([12, 99])
    assert torch.equal(again[0], first[1])  # same token at the same position after the same prefix
    with pytest.raises(ValueError):
        engine.rollback(engine.cache.length + 1)
    engine.close()


def test_generate_is_prefill_then_greedy_steps(tiny_packed_model):
    engine = load(tiny_packed_model("mixtral", "q4"))
    prompt = engine.tokenizer.encode(PROMPT)
    generated = [e.token_id for e in engine.generate(prompt, max_new_tokens=12, stop_at_eos=False)]
    engine.reset()
    logits, _ = engine.prefill(prompt)
    manual = []
    for _ in range(12):
        manual.append(int(logits[-1].argmax()))
        logits = engine.step([manual[-1]])
    assert generated == manual
    engine.close()


def test_step_refuses_what_does_not_fit(tiny_packed_model):
    engine = load(tiny_packed_model("olmoe", "q4"), max_context=32)
    engine.prefill(engine.tokenizer.encode(PROMPT))
    with pytest.raises(Exception, match="context"):
        engine.step([1] * 40)
    with pytest.raises(ValueError):
        engine.step([])
    engine.close()
