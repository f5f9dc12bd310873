"""Sequence slots on CUDA: sequences decoded together through step_many get exactly the bits each
gets alone, for every family, streamed and resident, with graphs on and off: a step's rows at once,
one graph per row count, each row's sequence slot and position device values over the paged KV pool."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

from batching_helpers import PROMPTS, SCHEDULE, alone, assert_same_bits, together

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "gemma4_text", "qwen3_next", "deepseek_v3"]


def load(packed, *, graphs=True, **opts):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "dtype": "bfloat16", "max_context": 256,
                                                        **opts}), graphs=graphs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_size,graphs", [("50%", True), ("all", True), ("50%", False)])
def test_sequences_decoded_together_get_the_bits_each_gets_alone(family, cache_size, graphs, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")  # the Triton layout
    single = load(packed, cache_size=cache_size, graphs=graphs)
    prompts = [single.tokenizer.encode(p) for p in PROMPTS]
    expected = [alone(single, p, end - begin) for p, (begin, end) in zip(prompts, SCHEDULE)]
    single.close()

    engine = load(packed, cache_size=cache_size, graphs=graphs, max_sequences=3)
    engine.close_sequence(0)
    got = together(engine, prompts, SCHEDULE)
    assert_same_bits(got, expected)
    if graphs:  # one attention segment per layer and row count (or one whole step), never per sequence
        assert all(len(k) <= 3 and not isinstance(k[-1], tuple) for k in engine.decoder.graphs)
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_one_graph_per_row_count_serves_every_arrangement(family, tiny_packed_model):
    """Every expert resident: every sequence's KV rows in one pool, each row's
    sequence a device value; steps of several sequences take one whole-step graph per row count and
    give each sequence's bits alone."""
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    single = load(packed, cache_size="all")
    prompts = [single.tokenizer.encode(p) for p in PROMPTS]
    expected = [alone(single, p, end - begin) for p, (begin, end) in zip(prompts, SCHEDULE)]
    single.close()

    engine = load(packed, cache_size="all", max_sequences=3)
    assert engine.decoder.rows_at_once
    engine.warm_steps(3)  # what `serve --parallel 3` does before the first request
    warmed = set(engine.decoder.graphs)
    assert {("step", 1), ("step", 2), ("step", 3)} <= warmed and all(c.length == 0 for c in engine.caches)
    engine.close_sequence(0)
    got = together(engine, prompts, SCHEDULE)
    assert_same_bits(got, expected)
    keys = set(engine.decoder.graphs)
    # every decode step of the schedule was captured before it began; the prompts (under 16 tokens)
    # prefilled as steps of their lengths
    assert keys - warmed <= {("step", len(p)) for p in prompts}
    assert not any(k[0] in ("attention", "attention-rows") or len(k) > 2 for k in keys)  # no segments, no arrangements
    engine.close()


def test_rollback_of_one_sequence_leaves_the_others_alone(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    engine = load(packed, cache_size="50%", max_sequences=2)
    a, b = engine.tokenizer.encode(PROMPTS[0]), engine.tokenizer.encode(PROMPTS[1])
    other = engine.open_sequence()
    engine.prefill(a)
    engine.prefill(b, seq=other)
    first = engine.step_many({0: [11, 12, 13], other: [21, 22]})
    engine.rollback(len(a) + 1)
    second = engine.step_many({0: [12, 99], other: [23]})
    assert torch.equal(second[0][0], first[0][1])
    engine.close()

    ref = load(packed, cache_size="50%")
    ref.prefill(b)
    assert torch.equal(torch.cat([first[other], second[other]]), ref.step([21, 22, 23]))
    ref.close()
