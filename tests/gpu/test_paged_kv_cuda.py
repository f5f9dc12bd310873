"""Every attention kind over the paged KV pool on CUDA: each family's greedy tokens equal the CPU
reference's (float32), a step of T tokens gives the bits of T one-token steps (graphs on and off), and
the tokens do not depend on the block size, on the slot a sequence lands in, or on whether a
prompt's prefix blocks were shared from an earlier sequence or computed again."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.kv import pool as kv_pool

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "minimax_m2", "gpt_oss", "gemma4_text",
            "qwen3_next", "deepseek_v3", "glm4_moe_lite"]


def load(packed, device: str, *, graphs: bool = True, **opts) -> Engine:
    opts = {"max_context": 256, "cache_size": "all", "dtype": "float32", **opts}
    return Engine.load(packed, options=EngineOptions(device=device, threads=1 if device == "cpu" else 0, **opts),
                       graphs=graphs)


def prompt_of(engine, n: int, seed: int = 0) -> list[int]:
    return [(7 * i + 3 + 11 * seed) % engine.args.vocab_size for i in range(n)]


def greedy(engine, prompt, n=12, *, seq=0):
    logits, _ = engine.prefill(prompt, seq=seq)
    rows, tokens = [logits[-1].float().cpu()], [int(logits[-1].argmax())]
    for _ in range(n):
        rows.append(engine.step([tokens[-1]], seq=seq)[-1].float().cpu())
        tokens.append(int(rows[-1].argmax()))
    return tokens, rows


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_tokens_on_cuda_equal_the_cpu_reference(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4")
    runs = {}
    for device in ("cpu", "cuda"):
        engine = load(packed, device)
        try:
            runs[device] = greedy(engine, prompt_of(engine, 70), 16)
        finally:
            engine.close()
    (want, want_rows), (got, got_rows) = runs["cpu"], runs["cuda"]
    assert got == want
    assert max(float((a - b).abs().max()) for a, b in zip(got_rows, want_rows)) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("graphs", [True, False])
def test_a_step_of_t_tokens_gives_the_bits_of_t_single_steps(family, graphs, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    engine = load(packed, "cuda", dtype="bfloat16", graphs=graphs)
    try:
        prompt = prompt_of(engine, 40)
        engine.prefill(prompt)
        base = engine.cache.length
        draft = prompt_of(engine, 16, seed=3)
        singles = torch.cat([engine.step([t]).clone() for t in draft])
        for T in (2, 5, 16):
            engine.rollback(base)
            assert torch.equal(engine.step(draft[:T]).clone(), singles[:T]), T
    finally:
        engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text", "deepseek_v3"])
def test_the_same_bits_whatever_the_block_size(family, tiny_packed_model, monkeypatch):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    runs = []
    for block_size in (16, 4, 1):
        monkeypatch.setattr(kv_pool, "BLOCK_SIZE", block_size)
        engine = load(packed, "cuda", dtype="bfloat16")
        try:
            assert engine.pool.block_size == block_size
            runs.append(greedy(engine, prompt_of(engine, 100), 12))
        finally:
            engine.close()
    for tokens, rows in runs[1:]:
        assert tokens == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(rows, runs[0][1]))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss", "gemma4_text"])
def test_shared_or_evicted_prefix_blocks_and_any_slot_give_the_same_tokens(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    engine = load(packed, "cuda", dtype="bfloat16", max_sequences=3)
    try:
        base = prompt_of(engine, 40)
        alone, alone_rows = greedy(engine, base + [9])
        engine.reset()
        engine.prefill(base + [5, 6])
        # slot 0 is running: the new sequence holds its blocks up to the first token that differs (the
        # partly filled third block too, copied before either writes it)
        first = engine.open_sequence(prefix=base + [9])
        assert engine.caches[first].tokens == base
        shared, shared_rows = greedy(engine, base + [9], seq=first)
        # the shared rows are the bits slot 0's prefill computed; the new token runs as a step
        assert float((shared_rows[0] - alone_rows[0]).abs().max()) < 5e-2 and shared[0] == alone[0]
        engine.close_sequence(first)
        engine.reset()  # slot 0 ends too, and no block answers a prefix's hash
        again = engine.open_sequence(prefix=base + [9])  # evicted: computed again, as alone
        assert engine.caches[again].tokens == []
        tokens, rows = greedy(engine, base + [9], seq=again)
        assert tokens == alone and all(torch.equal(a, b) for a, b in zip(rows, alone_rows))
    finally:
        engine.close()
