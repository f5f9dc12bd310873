"""Speculative decoding and the hot head on CUDA give plain decoding's tokens: streamed experts
(per-layer segments) and all experts resident (one graph per step length), greedy and sampled."""
import pytest

from moestream.engine.engine import Engine
from moestream.engine.hot_head import HotHeadOptions
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
    out, _ = run(engine, prompt, 48, speculative=SpeculativeOptions(hot_head=HotHeadOptions(base_tokens=256)))
    assert out == plain
    draft.close()
    engine.close()
