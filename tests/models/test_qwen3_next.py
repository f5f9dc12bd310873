"""Qwen3-Next / Qwen3.5 specifics beyond parity: long prompts (the chunked DeltaNet form and the
state snapshots inside one prefill) against transformers, rollback and prefix reuse with recurrent
layers (the same tokens as a fresh run), the state record, the layer pattern, what convert leaves out."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from moestream.kv.pool import KVPool
from moestream.kv.recurrent import RECENT_STATES, StateBook
from tiny import model_args
from test_parity import load_reference
from tiny import FAMILY_CONFIGS, TOKENIZER_TEXT

HYBRID = ["qwen3_next", "qwen3_5_moe"]


def load(packed, **opts):
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)


def long_prompt(engine) -> list[int]:
    ids = engine.tokenizer.encode(" ".join(TOKENIZER_TEXT))
    assert len(ids) > 3 * engine.cache.book.every  # several snapshots and chunks inside the prompt
    return ids


def greedy(engine, prompt, n):
    events = list(engine.generate(prompt, max_new_tokens=n, stop_at_eos=False, logprobs=1))
    return [e.token_id for e in events], [e.logprob for e in events]


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("chunk", [4096, 5])
def test_long_prompt_matches_transformers(family, chunk, tiny_checkpoint, tiny_packed_model):
    """Whole (chunked DeltaNet form, snapshots on its chunk ends) and in 5-token prefill chunks
    (each continuing from the state the one before kept)."""
    engine = load(tiny_packed_model(family, "none"), prefill_chunk_tokens=chunk)
    prompt = long_prompt(engine)
    logits, _ = engine.prefill(prompt, all_logits=True)
    with torch.no_grad():
        expected = load_reference(tiny_checkpoint(family))(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-4


@pytest.mark.parametrize("family", HYBRID)
def test_rollback_then_decode_gives_a_fresh_runs_tokens(family, tiny_packed_model, float_activations):
    packed = tiny_packed_model(family, "q4")
    fresh = load(packed)
    prompt = long_prompt(fresh)
    plain, plain_lp = greedy(fresh, prompt, 24)

    engine = load(packed)
    logits, _ = engine.prefill(prompt)
    rows = []
    for t in plain[:20]:
        rows.append(engine.step([t]))
    # within the last steps: the kept state is the step's own, so the logits are the same bits
    engine.rollback(len(prompt) + 6)
    again = torch.cat([engine.step([t]) for t in plain[6:12]])
    assert torch.equal(again, torch.cat(rows[6:12]))
    # further back than the ring (into the prompt): back to a snapshot, the rest recomputed
    back = len(prompt) - 9
    engine.rollback(back)
    assert engine.cache.length == back and engine.cache.tokens == prompt[:back]
    redo, redo_lp = greedy(engine, prompt, 24)
    assert redo == plain
    assert max(abs(a - b) for a, b in zip(redo_lp, plain_lp)) < 1e-4
    fresh.close()
    engine.close()


@pytest.mark.parametrize("family", HYBRID)
def test_prefix_reuse_gives_a_fresh_runs_tokens(family, tiny_packed_model):
    packed = tiny_packed_model(family, "none")
    engine, fresh = load(packed), load(packed)
    prompt = long_prompt(engine)
    first, _ = greedy(engine, prompt, 12)
    # the next prompt continues the last one: its states are among the recent ones
    longer = prompt + first[:3]
    gen = engine.generate(longer, max_new_tokens=9, stop_at_eos=False, logprobs=1)
    out = list(gen)
    assert gen.result.receipt["reused_tokens"] == len(longer) - 1
    assert [e.token_id for e in out] == first[3:]
    # a prompt that leaves the cached one mid-way: reuse goes back to the last snapshot before it
    every = engine.cache.book.every
    cut = 2 * every + 5
    other = prompt[:cut] + prompt[:20]
    gen = engine.generate(other, max_new_tokens=16, stop_at_eos=False, logprobs=1)
    reused = [e.token_id for e in gen]
    assert gen.result.receipt["reused_tokens"] == 2 * every
    want, want_lp = greedy(fresh, other, 16)
    assert reused == want
    engine.close()
    fresh.close()


def test_the_state_record_keeps_recent_lengths_and_snapshots():
    book = StateBook(256)
    assert book.every == 32 and book.snapshots == 9
    book.ran(0, 100)  # a prefill: the last RECENT_STATES lengths and the snapshots at 32, 64, 96
    assert sorted(x for x in book.recent if x >= 0) == list(range(100 - RECENT_STATES + 1, 101))
    assert book.kept[:4] == [True] * 4 and not any(book.kept[4:])
    assert book.restore(90, [], 0) == 90  # in the ring: nothing to recompute
    assert book.restore(80, [], 0) == 64  # before the ring: the snapshot below it
    assert max(book.recent) == 64 and not book.kept[3]  # what lay beyond 80 is forgotten
    book.ran(64, 65)
    assert book.restore(65, [], 0) == 65
    assert book.restore(10, [], 0) == 0  # the empty state is always there
    big = StateBook(32768)
    assert big.snapshots <= 17 and big.every % 32 == 0


def test_cache_bytes_are_what_the_ledger_counts(tiny_packed_model):
    args = load(tiny_packed_model("qwen3_next", "none")).args
    layout = args.kv_layout()
    assert [spec.recurrent for spec in layout] == [True, False, True, False]
    pool = KVPool(layout, max_sequences=2, max_context=256, dtype=torch.float32, device=torch.device("cpu"))
    assert pool.nbytes == KVPool.bytes_for(layout, sequences=2, max_context=256, dtype=torch.float32)
    assert pool.layer(0).states is not None and pool.layer(1).states is None and pool.layer(1).keys is not None


def test_layer_pattern_from_the_interval_and_refusals():
    config = dict(FAMILY_CONFIGS["qwen3_next"], model_type="qwen3_next", vocab_size=320, num_hidden_layers=8,
                  full_attention_interval=4)
    args = model_args("qwen3_next", config)
    assert args.layer_types == ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + \
        ["full_attention"]
    assert args.rope_parameters["partial_rotary_factor"] == 0.25  # transformers' default
    from moestream.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="layer_types") as info:
        model_args("qwen3_next", dict(config, layer_types=["sliding_attention"] * 8))
    assert "\n" not in str(info.value)
    with pytest.raises(UnsupportedModelError, match="hidden_act"):
        model_args("qwen3_next", dict(config, hidden_act="gelu"))


def test_multi_token_prediction_and_vision_weights_are_left_out(tiny_checkpoint, tmp_path):
    from moestream.convert.main import convert

    src = shutil.copytree(tiny_checkpoint("qwen3_next"), tmp_path / "src")
    tensors = load_file(src / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.zeros(64, 128)
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.zeros(64)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    names = PackedModel(convert(src, tmp_path / "packed", quant="none")).logical_dense_names()
    assert names and not any(n.startswith("mtp.") for n in names)
    names = PackedModel(convert(tiny_checkpoint("qwen3_5_moe"), tmp_path / "packed35", quant="none")).logical_dense_names()
    assert names and all(n.startswith("model.") or n == "lm_head.weight" for n in names)
    assert not any("visual" in n or "language_model" in n for n in names)


@pytest.mark.parametrize("family", HYBRID)
@pytest.mark.parametrize("wrong_at", [None, 2])
def test_speculation_gives_the_plain_tokens_and_bits(family, wrong_at, tiny_packed_model):
    """Drafts kept and rejected: every rollback lands on a state the verification step kept."""
    from moestream.engine.speculative import SpeculativeOptions
    from moestream.engine.types import SamplingParams
    from test_speculative import SAMPLED, Oracle, run

    engine = load(tiny_packed_model(family, "q4"))
    prompt = long_prompt(engine)
    for sampling in (SamplingParams(), SAMPLED):
        plain, plain_events, _ = run(engine, prompt, 30, sampling, logprobs=2)
        spec = SpeculativeOptions(drafter=Oracle(prompt, plain, wrong_at), draft_tokens=5)
        out, events, result = run(engine, prompt, 30, sampling, spec, logprobs=2)
        assert out == plain
        assert [e.top_logprobs for e in events] == [e.top_logprobs for e in plain_events]
        r = result.receipt["speculative"]
        assert r["accepted"] > 0 and (r["accepted"] < r["drafted"]) == (wrong_at is not None)
    engine.close()
