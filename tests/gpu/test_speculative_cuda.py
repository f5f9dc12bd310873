"""Speculative decoding and the hot head on CUDA give plain decoding's tokens: streamed experts
(per-layer segments) and all experts resident (one graph per step length), greedy and sampled."""
import pytest

from moestream.engine.engine import Engine
from moestream.engine.hot_head import DRAFT_TOKENS, HotHeadDrafter
from moestream.engine.options import EngineOptions
from moestream.engine.speculative import DraftModelDrafter, NGramDrafter, SpeculativeOptions
from moestream.engine.types import SamplingParams

pytestmark = pytest.mark.gpu
PROMPT = ("class Vector:\n    def add(self, other):\n        return Vector(self.x + other.x)\n"
          "    def sub(self, other):\n")


def run(engine, prompt, n, sampling=SamplingParams(), speculative=None):
    engine.reset()
    gen = engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop_at_eos=False, speculative=speculative)
    return [e.token_id for e in gen], gen.result


@pytest.mark.parametrize("cache_size", ["30%", "all"])
def test_demo_model_speculation_on_cuda(cache_size):
    engine = Engine.load(options=EngineOptions(device="cuda", cache_size=cache_size))
    draft = DraftModelDrafter(Engine.load(options=EngineOptions(device="cuda", cache_size="all")))
    prompt = engine.tokenizer.encode(PROMPT)
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=11)):
        plain, _ = run(engine, prompt, 64, sampling)
        for spec in (SpeculativeOptions(drafter=NGramDrafter()), SpeculativeOptions(drafter=NGramDrafter(), draft_tokens=6),
                     SpeculativeOptions(drafter=draft, draft_tokens=3)):
            out, result = run(engine, prompt, 64, sampling, spec)
            assert out == plain, (sampling, spec.drafter.name, spec.draft_tokens)
            assert result.receipt["speculative"]["accepted"] > 0
    plain, _ = run(engine, prompt, 48)
    out, _ = run(engine, prompt, 48, speculative=SpeculativeOptions(drafter=HotHeadDrafter(engine, base_tokens=256),
                                                                    draft_tokens=DRAFT_TOKENS))
    assert out == plain
    draft.close()
    engine.close()


@pytest.mark.parametrize("cache_size", ["30%", "all"])
def test_step_hidden_and_head_rows_give_the_step_bits_on_cuda(cache_size):
    """The fixed-shape head: a step's logits, a step that stops before the head, then the head over
    the saved rows (one pass) or a few of them: the same bits; segments (30 %) and whole-step graphs."""
    import torch

    engine = Engine.load(options=EngineOptions(device="cuda", cache_size=cache_size))
    prompt = engine.tokenizer.encode(PROMPT)
    tokens = [5, 17, 3, 99, 42, 7]
    engine.reset()
    engine.prefill(prompt)
    for T in (1, 3, 6):
        engine.rollback(len(prompt))
        logits = engine.step(tokens[:T])
        engine.rollback(len(prompt))
        hidden = engine.step_hidden(tokens[:T])
        assert torch.equal(engine.head_rows(hidden), logits), T
        assert torch.equal(engine.head_rows(hidden[-1:]), logits[-1:]), T
    engine.rollback(len(prompt))
    singles = torch.cat([engine.step_hidden([t]) for t in tokens])
    engine.rollback(len(prompt))
    assert torch.equal(engine.head_rows(singles), engine.step(tokens))
    engine.close()


@pytest.mark.parametrize("cache_size", ["30%", "all"])
def test_hot_head_over_200_tokens_on_cuda(cache_size):
    engine = Engine.load(options=EngineOptions(device="cuda", cache_size=cache_size))
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    plain, _ = run(engine, prompt, 220)
    for options in (SpeculativeOptions(drafter=HotHeadDrafter(engine), draft_tokens=DRAFT_TOKENS),
                    SpeculativeOptions(drafter=HotHeadDrafter(engine, prompt_tokens=16, base_tokens=256),
                                       draft_tokens=5)):
        out, result = run(engine, prompt, 220, speculative=options)
        assert out == plain
        assert result.receipt["speculative"]["accepted"] > 0
    engine.close()


@pytest.mark.parametrize("cache_size", ["25%", "all"])
def test_shipped_draft_on_cuda(cache_size):
    """The demo's shipped draft model (moestream/demo/model/draft), as `--draft auto` loads it, on
    CUDA: plain decoding's tokens over 200 tokens, greedy and sampled, fixed and adaptive lengths."""
    from moestream.engine.engine import DEMO_MODEL
    from moestream.engine.draft_choice import make_options, shipped_draft

    draft_dir = shipped_draft(DEMO_MODEL)
    assert draft_dir is not None, "the demo model ships moestream/demo/model/draft"
    options = EngineOptions(device="cuda", cache_size=cache_size)
    engine = Engine.load(options=options)
    adaptive = make_options("draft", str(draft_dir), draft_tokens=None, main_engine=engine, engine_options=options)
    fixed = SpeculativeOptions(drafter=adaptive.drafter, draft_tokens=4)
    prompt = engine.tokenizer.encode('def read_config(path):\n    """Read a configuration file."""\n')
    for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=7)):
        plain, _ = run(engine, prompt, 200, sampling)
        for spec in (fixed, adaptive):
            out, result = run(engine, prompt, 200, sampling, spec)
            assert out == plain, (sampling, spec.draft_tokens)
        assert result.receipt["speculative"]["drafter"] == "draft"
    adaptive.drafter.close()
    engine.close()
