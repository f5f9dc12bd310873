"""Prefill graphs on CUDA: a fresh prompt's chunk replayed from its length bucket's graph gives the
bits of the same padded chunk run eagerly (without CUDA graphs, or at a partial cache, where no graph
runs: the bits do not depend on the cache size), reuses one graph per bucket and row-block choice, and
decodes the same tokens; against the unpadded prefill (the engine's graphs taken away) the logits are close."""
import functools
import inspect

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu

LENGTHS = (23, 30, 64, 100, 200)  # the tiny model: 256 positions


def load(packed, mode: str = "auto", *, graphs: bool = True, **options) -> Engine:
    """mode: auto (the engine's: a bucket captured at its second prompt), on (captured at its first) or
    off (no padding: the graphs taken away)."""
    engine = Engine.load(packed, options=EngineOptions(device="cuda", max_context=256, **options), graphs=graphs)
    if mode == "off":
        engine.prefill_graphs = None
    elif mode == "on":
        engine.prefill_graphs.capture_after = 0
    return engine


def prefills(packed, dtype, mode="auto", **options):
    engine = load(packed, mode, dtype=dtype, **options)
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
def test_prefill_graphs_give_the_padded_eager_bits(dtype, tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    unpadded, none = prefills(packed, dtype, "off", cache_size="all")
    graphed, keys = prefills(packed, dtype, "on", cache_size="all")
    eager, no_graphs = prefills(packed, dtype, cache_size="all", graphs=False)
    streamed, _ = prefills(packed, dtype, cache_size="50%")
    assert none is None and keys and not no_graphs, "the graphs did not run, or ran without CUDA graphs"
    assert {k[0] for k in keys} == {32, 64, 128, 256}  # 23 and 30 share the 32 bucket
    bound = 2e-2 if dtype == "bfloat16" else 1e-4
    for (ref, ref_tokens), (got, tokens), (part, part_tokens), (off, _) in zip(eager, graphed, streamed, unpadded):
        assert torch.equal(got, ref), (got - ref).abs().max()
        assert torch.equal(part, ref), (part - ref).abs().max()
        assert tokens == ref_tokens == part_tokens
        assert torch.allclose(off, ref, rtol=bound, atol=bound)


def test_a_bucket_replayed_after_the_hits_were_read(tiny_packed_model):
    """A bucket's graph captured (23 tokens), the hit counter read (every generate reads it), the graph
    replayed for another length of the bucket (30), then a decode step, with a sync after each: the
    padded eager prefill's logits and hits (the real rows'), and the same step."""
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    runs = {}
    for mode in ("eager", "on"):
        engine = load(packed, "on", dtype="bfloat16", cache_size="all", graphs=mode == "on")
        try:
            vocab, out = engine.args.vocab_size, []
            for n in (23, 30, 23):
                prompt = [(11 * i + n) % vocab for i in range(n)]
                engine.reset()
                before = engine.expert_stats()["hits"]
                logits, _ = engine.prefill(prompt)
                torch.cuda.synchronize()
                hits = engine.expert_stats()["hits"] - before
                step = engine.step([5]).clone()
                torch.cuda.synchronize()
                out.append((logits.clone(), hits, step))
            runs[mode] = out
            if mode == "on":
                assert {key[0] for key in engine.prefill_graphs.graphs} == {32}
        finally:
            engine.close()
    for (ref, ref_hits, ref_step), (got, hits, step) in zip(runs["eager"], runs["on"]):
        assert torch.equal(got, ref) and torch.equal(step, ref_step)
        assert hits == ref_hits > 0


@pytest.mark.skipif("check_input_liveness" not in inspect.signature(torch.cuda.graph.__init__).parameters,
                    reason="this torch cannot track a graph's inputs")
def test_no_replay_reads_a_tensor_freed_since_its_capture(tiny_packed_model, monkeypatch):
    """Every capture (prefill and decoder graphs) with torch's input-liveness tracking: a replay raises,
    naming the tensor, where a torch op of the capture used a tensor that has been freed since."""
    monkeypatch.setattr(torch.cuda, "graph", functools.partial(torch.cuda.graph, check_input_liveness=True))
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    _, keys = prefills(packed, "bfloat16", "on", cache_size="all")
    assert {k[0] for k in keys} == {32, 64, 128, 256}


def test_auto_captures_a_bucket_at_its_second_prompt(tiny_packed_model):
    """A capture costs more than a few eager prefills: auto runs a bucket's first prompt padded but
    eagerly (the same bits), captures at the second and replays from the third."""
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    engine = load(packed, dtype="bfloat16", cache_size="all")
    try:
        prompt = [(11 * i + 3) % engine.args.vocab_size for i in range(40)]
        got = []
        for _ in range(3):
            engine.reset()
            got.append((engine.prefill(prompt)[0].clone(), len(engine.prefill_graphs.graphs)))
        assert [n for _, n in got] == [0, 1, 1]
        assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[1][0], got[2][0])
    finally:
        engine.close()
