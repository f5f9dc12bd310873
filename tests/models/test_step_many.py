"""Sequence slots and step_many: sequences decoding together get exactly the bits each gets alone,
for every family (CPU); rollback of one leaves the others alone; one step fetches the union of
the experts its rows route to once per layer."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError

from batching_helpers import PROMPTS, SCHEDULE, STEPS, alone, assert_same_bits, together

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]


def load(packed, **opts):
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cache_size", ["min", "all"])
def test_sequences_decoded_together_get_the_bits_each_gets_alone(family, cache_size, tiny_packed_model):
    packed = tiny_packed_model(family, "q4")
    single = load(packed, cache_size=cache_size)
    prompts = [single.tokenizer.encode(p) for p in PROMPTS]
    expected = [alone(single, p, end - begin) for p, (begin, end) in zip(prompts, SCHEDULE)]
    single.close()

    engine = load(packed, cache_size=cache_size, max_sequences=3)
    engine.close_sequence(0)  # every slot through open_sequence
    got = together(engine, prompts, SCHEDULE)
    assert engine.open_sequences == [0, 1, 2]
    assert_same_bits(got, expected)
    engine.close()


def test_rollback_of_one_sequence_leaves_the_others_alone(tiny_packed_model):
    engine = load(tiny_packed_model("qwen2_moe", "q4"), cache_size="min", max_sequences=2)
    a, b = engine.tokenizer.encode(PROMPTS[0]), engine.tokenizer.encode(PROMPTS[1])
    other = engine.open_sequence()
    engine.prefill(a)
    engine.prefill(b, seq=other)
    first = engine.step_many({0: [11, 12, 13], other: [21, 22]})
    engine.rollback(len(a) + 1)  # slot 0 keeps its first drafted token only
    assert engine.cache.tokens == a + [11]
    assert engine.caches[other].tokens == b + [21, 22]
    second = engine.step_many({0: [12, 99], other: [23]})
    assert torch.equal(second[0][0], first[0][1])  # same token at the same position after the same prefix
    engine.close()

    ref = load(tiny_packed_model("qwen2_moe", "q4"), cache_size="min")
    ref.prefill(b)
    assert torch.equal(torch.cat([first[other], second[other]]), ref.step([21, 22, 23]))
    ref.close()


def test_a_step_fetches_the_union_of_its_rows_experts_once_per_layer(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4")
    # a pool smaller than one step's union: every lookup tends to miss, so the union's overlap is
    # what batching saves (with a pool that holds one sequence's reuse but not three interleaved
    # working sets, batching misses more: 149 against 63 at 40 % on this model)
    cache_size = "min"
    engine = load(packed, cache_size=cache_size, max_sequences=3)
    prompts = [engine.tokenizer.encode(p) for p in PROMPTS]
    slots = [0, engine.open_sequence(), engine.open_sequence()]
    last = {}
    for s, p in zip(slots, prompts):
        logits, _ = engine.prefill(p, seq=s)
        last[s] = int(logits[-1].argmax())
    routed = []
    engine.experts.on_route = lambda layer, ids: routed.append(ids.tolist())
    before = engine.expert_stats()
    for _ in range(STEPS):
        logits = engine.step_many({s: [last[s]] for s in slots})
        last = {s: int(logits[s][-1].argmax()) for s in slots}
    after = engine.expert_stats()
    lookups = (after["hits"] + after["misses"]) - (before["hits"] + before["misses"])
    moe_layers = len(engine.args.moe_layers())
    assert len(routed) == STEPS * moe_layers  # one host half per MoE layer per step
    assert all(len(ids) == len(slots) for ids in routed)  # ... over the rows of every sequence
    assert lookups == sum(len({e for row in ids for e in row}) for ids in routed)  # the union, once
    assert lookups < sum(len(row) for ids in routed for row in ids)  # fewer than each row for itself
    batched_misses = after["misses"] - before["misses"]
    engine.close()

    separate = load(packed, cache_size=cache_size)  # the same sequences one after another
    separate_misses = 0
    for p in prompts:
        separate.reset()
        logits, _ = separate.prefill(p)
        before = separate.expert_stats()["misses"]  # decode steps only, as above
        for _ in range(STEPS):
            logits = separate.step([int(logits[-1].argmax())])
        separate_misses += separate.expert_stats()["misses"] - before
    separate.close()
    assert batched_misses < separate_misses


def test_slots_refuse_what_they_cannot_do(tiny_packed_model):
    packed = tiny_packed_model("olmoe", "q4")
    engine = load(packed, max_sequences=2, max_context=64)
    one = load(packed, max_context=64)
    # the context is a limit: two slots share a pool smaller than two whole contexts (kv/pool.py)
    assert one.plan.ledger.kv_cache < engine.plan.ledger.kv_cache == engine.pool.nbytes < 2 * one.plan.ledger.kv_cache
    one.close()
    slot = engine.open_sequence()
    with pytest.raises(MoestreamError, match="slots are open"):
        engine.open_sequence()
    with pytest.raises(ValueError, match="does not exist"):
        engine.step_many({5: [1]})
    engine.close_sequence(slot)
    with pytest.raises(ValueError, match="not open"):
        engine.step_many({slot: [1]})
    with pytest.raises(ValueError, match="not open"):
        engine.prefill([1, 2], seq=slot)
    with pytest.raises(ValueError, match="at least one"):
        engine.step_many({0: []})
    with pytest.raises(ValueError, match="at least one"):
        engine.step_many({})
    engine.prefill([1, 2, 3])
    with pytest.raises(Exception, match="context"):
        engine.step_many({0: [1] * 70})
    assert engine.cache.tokens == [1, 2, 3]  # a refused step changes nothing
    engine.close()


def test_a_new_sequence_shares_the_blocks_of_an_ended_one(tiny_packed_model):
    """An ended sequence's full blocks stay published: a prompt starting the same way, in any slot,
    shares them rather than computing them again, and decodes as the first did."""
    engine = load(tiny_packed_model("mixtral", "q4"), max_sequences=3)
    engine.close_sequence(0)
    first = engine.open_sequence()
    prompt = [(5 * i + 1) % engine.args.vocab_size for i in range(40)]  # two full blocks of 16 and a part
    logits, _ = engine.prefill(prompt, seq=first)
    engine.close_sequence(first)
    again = engine.open_sequence(prefix=prompt[:35] + [3, 4])
    assert engine.caches[again].tokens == prompt[:32]
    group = engine.pool.groups[None]
    assert all(group.allocator.refs[b] == 1 for b in group.held[again][:2])
    shared, reused = engine.prefill(prompt, seq=again)
    assert reused == 32
    torch.testing.assert_close(shared, logits, rtol=1e-4, atol=1e-4)
    fresh = engine.open_sequence()
    assert engine.caches[fresh].tokens == []
    engine.close()
