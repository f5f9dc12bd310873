"""--prefill-kernels fused: a prefill's attention half on the decode step's fused kernels gives the torch
prefill's logits within the dtype's tolerance and its greedy tokens (float32), and the same bits for every
cache size; the layers whose attention it cannot compute keep the torch prefill."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu


def load(packed, **options):
    return Engine.load(packed, options=EngineOptions(device="cuda", max_context=512, **options))


def greedy(engine, prompt, n=24):
    logits = engine.prefill(prompt)[0][-1]
    out = [int(logits.argmax())]
    for _ in range(n - 1):
        out.append(int(engine.step([out[-1]])[-1].argmax()))
    return logits.clone(), out


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_fused_prefill_gives_the_torch_prefill(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="float32")
    prompt = list(range(5, 300))
    results = {}
    for kernels in ("torch", "fused"):
        engine = load(packed, dtype="float32", cache_size="all", prefill_kernels=kernels)
        try:
            assert any(getattr(layer, "fused_prefill", False) for layer in engine.model.layers) == (kernels == "fused")
            results[kernels] = greedy(engine, [t % engine.args.vocab_size for t in prompt])
        finally:
            engine.close()
    (ref, ref_tokens), (got, tokens) = results["torch"], results["fused"]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-4
    assert tokens == ref_tokens


def test_fused_prefill_bits_do_not_depend_on_the_cache_size(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    runs = []
    for size in ("all", "50%"):
        engine = load(packed, dtype="bfloat16", cache_size=size, prefill_kernels="fused")
        try:
            runs.append(greedy(engine, [t % engine.args.vocab_size for t in range(7, 200)], n=8))
        finally:
            engine.close()
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1] == runs[1][1]
