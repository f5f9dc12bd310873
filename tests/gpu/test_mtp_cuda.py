"""The MTP drafter on CUDA: speculative decoding with it gives plain decoding's tokens, streamed
(the MTP layer's experts through the slot cache) and all experts resident, greedy and sampled; its
float32 drafts are the CPU drafter's."""
import pytest
import torch
from mtp_checkpoints import build_mtp_checkpoint

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.mtp_drafter import MTPDrafter
from moestream.engine.options import EngineOptions
from moestream.engine.speculative import SpeculativeOptions
from moestream.engine.types import SamplingParams

pytestmark = pytest.mark.gpu
PROMPT = "def fibonacci(n):\n    if n < 2:"
FAMILIES = ["deepseek_v3", "glm4_moe", "qwen3_next", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    cache = {}

    def make(family, quant):
        if family not in cache:
            cache[family] = build_mtp_checkpoint(tmp_path_factory.mktemp(f"mtp-{family}") / "hf", family)
        if (family, quant) not in cache:
            cache[family, quant] = convert(cache[family], cache[family].parent / quant, quant=quant, progress=False)
        return cache[family, quant]

    return make


def run(engine, prompt, n, sampling=SamplingParams(), speculative=None):
    engine.reset()
    gen = engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop_at_eos=False, speculative=speculative)
    return [e.token_id for e in gen], gen.result


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_size", ["30%", "all"])
def test_mtp_speculation_gives_the_plain_tokens_on_cuda(family, cache_size, packed):
    model = packed(family, "q4")
    opts = EngineOptions(device="cuda", cache_size=cache_size)
    plain_engine = Engine.load(model, options=opts)
    prompt = plain_engine.tokenizer.encode(PROMPT)
    samplings = (SamplingParams(), SamplingParams(temperature=0.8, top_k=50, seed=11))
    expected = [run(plain_engine, prompt, 64, s)[0] for s in samplings]
    plain_engine.close()
    engine = Engine.load(model, options=opts)
    drafter = MTPDrafter(engine)
    for sampling, plain in zip(samplings, expected):
        for k in (1, 3, None):
            out, result = run(engine, prompt, 64, sampling, SpeculativeOptions(drafter=drafter, draft_tokens=k))
            assert out == plain, (sampling, k)
            assert result.receipt["speculative"]["drafted"] > 0
    drafter.close()
    engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_drafts_on_cuda_are_the_cpu_drafts(family, packed):
    model = packed(family, "none")
    drafts = {}
    for device in ("cpu", "cuda"):
        engine = Engine.load(model, options=EngineOptions(device=device, dtype="float32", cache_size="30%"))
        drafter = MTPDrafter(engine)
        prompt = engine.tokenizer.encode(PROMPT)
        engine.prefill(prompt)
        tokens = drafter.propose(prompt, 4)
        drafts[device] = tokens, torch.stack(drafter.last_logits).cpu()
        drafter.close()
        engine.close()
    assert drafts["cuda"][0] == drafts["cpu"][0]
    torch.testing.assert_close(drafts["cuda"][1], drafts["cpu"][1], rtol=0, atol=2e-3)
