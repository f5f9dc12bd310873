"""The paged KV pool under whole engines (CPU): the same logits and tokens whatever the block size,
whatever order and slots sequences arrive in, and whether a prompt's prefix blocks are shared from an
earlier sequence or computed again; a sliding-window layer keeps only the blocks its window sees."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.kv import pool as kv_pool

FAMILIES = ["qwen3_moe", "gpt_oss", "gemma4_text", "qwen3_next", "deepseek_v3"]


def load(packed, **opts) -> Engine:
    opts.setdefault("max_context", 256)
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)


def prompt_of(engine, n: int, seed: int = 0) -> list[int]:
    vocab = engine.args.vocab_size
    return [(7 * i + 3 + 11 * seed) % vocab for i in range(n)]


def greedy(engine, prompt, n=12, *, seq=0):
    logits, _ = engine.prefill(prompt, seq=seq)
    rows, tokens = [logits[-1].clone()], [int(logits[-1].argmax())]
    for _ in range(n):
        rows.append(engine.step([tokens[-1]], seq=seq)[-1].clone())
        tokens.append(int(rows[-1].argmax()))
    return tokens, rows


@pytest.mark.parametrize("family", FAMILIES)
def test_the_same_bits_whatever_the_block_size(family, tiny_packed_model, monkeypatch):
    packed = tiny_packed_model(family, "q4")
    runs = []
    for block_size in (16, 3, 1):
        monkeypatch.setattr(kv_pool, "BLOCK_SIZE", block_size)
        engine = load(packed)
        assert engine.pool.block_size == block_size
        runs.append(greedy(engine, prompt_of(engine, 70)))
        engine.close()
    for tokens, rows in runs[1:]:
        assert tokens == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(rows, runs[0][1]))


@pytest.mark.parametrize("family", ["qwen3_moe", "gemma4_text", "qwen3_next"])
def test_sequences_get_their_own_bits_whatever_order_and_slot_they_arrive_in(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4")
    alone = {}
    engine = load(packed)
    for seed in (1, 2):
        engine.reset()
        alone[seed] = greedy(engine, prompt_of(engine, 30 + seed, seed), 6)
    engine.close()
    for order in ((1, 2), (2, 1)):
        engine = load(packed, max_sequences=3)
        slots = {}
        for seed in order:  # opened and prefilled in this order, each in the slot it gets
            slots[seed] = engine.open_sequence()
            engine.prefill(prompt_of(engine, 30 + seed, seed), seq=slots[seed])
        tokens = {seed: [alone[seed][0][0]] for seed in order}
        for _ in range(6):  # decoded together, each step one row per sequence
            out = engine.step_many({slots[s]: [tokens[s][-1]] for s in order})
            for s in order:
                assert torch.equal(out[slots[s]][-1], alone[s][1][len(tokens[s])])
                tokens[s].append(int(out[slots[s]][-1].argmax()))
        assert tokens == {s: alone[s][0][:7] for s in order}
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "deepseek_v3"])
def test_shared_or_evicted_prefix_blocks_give_the_same_tokens(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4")
    engine = load(packed, max_sequences=2)
    base = prompt_of(engine, 40)
    engine.prefill(base + [5, 6])
    first = engine.open_sequence(prefix=base + [9])  # holds base's blocks: two full, the third partly filled
    assert engine.caches[first].tokens == base
    group = engine.pool.groups[None]
    assert all(group.allocator.refs[b] == 2 for b in group.held[first][:3])
    shared = greedy(engine, base + [9], seq=first)[0]
    engine.close_sequence(first)
    engine.reset()  # sequence 0 gone too,
    engine.pool.forget_published()  # and its blocks evicted: computed again
    again = engine.open_sequence(prefix=base + [9])
    assert engine.caches[again].tokens == []
    assert greedy(engine, base + [9], seq=again)[0] == shared
    engine.close()


@pytest.mark.parametrize("family", ["gpt_oss", "gemma4_text"])
def test_a_window_layer_keeps_only_the_blocks_its_window_sees(family, tiny_packed_model, monkeypatch):
    monkeypatch.setattr(kv_pool, "BLOCK_SIZE", 4)
    engine = load(tiny_packed_model(family, "q4"))
    window = engine.args.sliding_window
    tokens, _ = greedy(engine, prompt_of(engine, 120), 8)
    held = {w: sum(b >= 0 for b in g.held[0]) for w, g in engine.pool.groups.items()}
    assert held[None] == -(-engine.cache.length // 4)
    assert held[window] <= -(-(window + kv_pool.ROLLBACK_MARGIN) // 4) + 2 < held[None]
    # a rollback within the margin keeps its blocks: the same tokens again
    length = engine.cache.length
    engine.rollback(length - 8)
    assert engine.cache.length == length - 8
    again = [int(engine.step([t])[-1].argmax()) for t in tokens[-9:-1]]
    assert again == tokens[-8:]
    engine.close()
