"""--prefill-graphs: a fresh prompt's chunk padded to its length bucket gives the eager prefill's
next-token logits (CPU: the padding run eagerly, `on`), and only where it can."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.prefill_graphs import SMALLEST, PrefillGraphs, bucket
from moestream.engine.types import SamplingParams


def load(packed, mode: str, **opts) -> Engine:
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, prefetch="none", cache_size="all",
                                                     prefill_graphs=mode, **opts))


def test_buckets_are_powers_of_two_from_the_smallest():
    assert [bucket(n) for n in (1, 17, 32, 33, 100, 512, 513, 2048)] == [32, 32, 32, 64, 128, 512, 1024, 2048]
    assert SMALLEST == 32


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])  # deepseek_v3: dense first layers, shared expert
def test_padded_prefill_gives_the_eager_logits_and_tokens(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4")
    runs = {}
    for mode in ("off", "on"):
        engine = load(packed, mode)
        try:
            assert (engine.prefill_graphs is not None) == (mode == "on" and family == "qwen3_moe")
            vocab = engine.args.vocab_size
            out = []
            for n in (23, 64, 100):  # inside a bucket, a full bucket, another bucket
                prompt = [(7 * i + 3) % vocab for i in range(n)]
                engine.reset()
                logits, _ = engine.prefill(prompt)
                tokens = [e.token_id for e in engine.generate(prompt, max_new_tokens=8, stop_at_eos=False,
                                                               sampling=SamplingParams())]
                out.append((logits.clone(), tokens, list(engine.cache.tokens)))
            runs[mode] = out
        finally:
            engine.close()
    for (ref, ref_tokens, ref_cache), (got, tokens, cache) in zip(runs["off"], runs["on"]):
        assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4)
        assert tokens == ref_tokens and cache == ref_cache


def test_only_fresh_chunks_of_a_fitting_model_are_padded(tiny_packed_model):
    engine = load(tiny_packed_model("qwen3_moe", "q4"), "on")
    graphs = engine.prefill_graphs
    assert isinstance(graphs, PrefillGraphs) and not graphs.capture
    cache = engine.cache
    assert graphs.takes(17, 0, cache) and graphs.takes(cache.max_tokens, 0, cache)  # 256: a bucket
    assert not graphs.takes(16, 0, cache)  # a step's graph takes those
    assert not graphs.takes(40, 5, cache)  # keys would not have the bucket's length
    assert not graphs.takes(cache.max_tokens - 50, 0, cache) or bucket(cache.max_tokens - 50) <= cache.max_tokens
    assert not graphs.takes(200, 0, cache) if bucket(200) > cache.max_tokens else graphs.takes(200, 0, cache)
    assert not PrefillGraphs(engine.model, engine.experts, largest=64, capture=False).takes(65, 0, cache)
    calls = []
    graphs.run = lambda piece, c: calls.append(len(piece)) or PrefillGraphs.run(graphs, piece, c)
    vocab = engine.args.vocab_size
    engine.prefill([(5 * i) % vocab for i in range(40)])
    engine.prefill([(5 * i) % vocab for i in range(40)] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
    engine.prefill([(5 * i) % vocab for i in range(40)], all_logits=True)
    assert calls == [40]  # the second reused 40 tokens (start 40), the third wants every row's logits
    engine.close()
    off = load(tiny_packed_model("qwen3_moe", "q4"), "auto")  # auto: CUDA only
    assert off.prefill_graphs is None
    off.close()
