"""--prefill-graphs on CUDA: a fresh prompt's chunk replayed from its length bucket's graph gives the
eager prefill's logits bit for bit (so the bits still do not depend on the cache size: a partial cache
prefills eagerly), reuses one graph per bucket and row-block choice, and decodes the same tokens."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu

LENGTHS = (23, 30, 64, 100, 200)  # the tiny model: 256 positions


def prefills(packed, dtype, **options):
    engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype=dtype, max_context=256, **options))
    try:
        vocab = engine.args.vocab_size
        out = []
        for n in LENGTHS:
            prompt = [(11 * i + n) % vocab for i in range(n)]
            engine.reset()
            logits, _ = engine.prefill(prompt)
            tokens = [e.token_id for e in engine.generate(prompt + [5], max_new_tokens=12, stop_at_eos=False)]
            out.append((logits.clone(), tokens))
        graphs = engine.prefill_graphs
        return out, (sorted(graphs.graphs) if graphs is not None else None)
    finally:
        engine.close()


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_prefill_graphs_give_the_eager_bits(dtype, tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    eager, none = prefills(packed, dtype, cache_size="all", prefill_graphs="off")
    graphed, keys = prefills(packed, dtype, cache_size="all", prefill_graphs="auto")
    streamed, _ = prefills(packed, dtype, cache_size="50%")
    assert none is None and keys, "the graphs did not run"
    assert len({k[0] for k in keys}) == len(keys) or len(keys) < len(LENGTHS)  # 23 and 30 share the 32 bucket
    assert {k[0] for k in keys} == {32, 64, 128, 256}
    for (ref, ref_tokens), (got, tokens), (part, part_tokens) in zip(eager, graphed, streamed):
        assert torch.equal(got, ref), (got - ref).abs().max()
        assert torch.equal(part, ref)
        assert tokens == ref_tokens == part_tokens
