"""Prefill graphs: a fresh prompt's chunk padded to its length bucket gives the eager prefill's
next-token logits (here on the CPU, the padding run eagerly: `on`), and only where it can."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.prefill_graphs import SMALLEST, PrefillGraphs, bucket
from moestream.engine.types import SamplingParams
from moestream.layers.experts import padding_on_last_row


def load(packed, mode: str, **opts) -> Engine:
    """A CPU engine; mode "on": its fresh chunks padded as a CUDA engine's are (eagerly, nothing captured)."""
    opts.setdefault("cache_size", "all")
    engine = Engine.load(packed, options=EngineOptions(device="cpu", threads=1, **opts), prefetch=False)
    assert engine.prefill_graphs is None  # CUDA only
    if mode == "on" and PrefillGraphs.fits(engine.pool):
        engine.prefill_graphs = PrefillGraphs(engine.model, engine.experts, engine.pool,
                                              largest=engine.plan.prefill_chunk, capture=False)
    return engine


def test_buckets_are_powers_of_two_from_the_smallest():
    assert [bucket(n) for n in (1, 17, 32, 33, 100, 512, 513, 2048)] == [32, 32, 32, 64, 128, 512, 1024, 2048]
    assert SMALLEST == 32


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "qwen3_next"])  # dense first layers; recurrent
def test_padded_prefill_gives_the_eager_logits_and_tokens(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4")
    runs = {}
    for mode in ("off", "on"):
        engine = load(packed, mode)
        try:
            assert (engine.prefill_graphs is not None) == (mode == "on" and family != "qwen3_next")
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
    context = engine.max_context
    assert graphs.takes(17, 0, 0) and graphs.takes(context, 0, 0)  # 256: a bucket
    assert not graphs.takes(16, 0, 0)  # a step's graph takes those
    assert not graphs.takes(40, 5, 0)  # not a fresh chunk
    assert not graphs.takes(200, 0, 0) if bucket(200) > context else graphs.takes(200, 0, 0)
    assert not PrefillGraphs(engine.model, engine.experts, engine.pool, largest=64, capture=False).takes(65, 0, 0)
    calls = []
    graphs.run = lambda piece, c: calls.append(len(piece)) or PrefillGraphs.run(graphs, piece, c)
    vocab = engine.args.vocab_size
    engine.prefill([(5 * i) % vocab for i in range(40)])
    engine.prefill([(5 * i) % vocab for i in range(40)] + [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17])
    engine.prefill([(5 * i) % vocab for i in range(40)], all_logits=True)
    assert calls == [40]  # the second reused 40 tokens (start 40), the third wants every row's logits
    engine.close()


def resident_on_cpu(engine: Engine) -> None:
    """Every expert in a slot for good and the layers reading the resident tables, as
    ExpertCache.make_resident leaves a CUDA engine (the CPU's engine never asks for it)."""
    provider = engine.provider
    for layer in provider.moe_layers:
        experts = list(range(provider.entries[layer].num_experts))
        provider.fetch(layer, experts, views=False)
        provider.resident_tables[layer] = torch.tensor(provider.slots_of(layer, experts), dtype=torch.int32)
    engine.experts.resident = True


def test_padded_prefill_books_the_real_rows_hits_after_the_run(tiny_packed_model):
    """The resident hits are counted outside the padded run (a graph must not add into the engine's
    counter), for the real rows only: the eager prefill's figures."""
    packed = tiny_packed_model("qwen3_moe", "q4")
    hits, counted = {}, {}
    for mode in ("off", "on"):
        engine = load(packed, mode)
        try:
            resident_on_cpu(engine)
            provider, rows = engine.provider, []
            count_one, count_many = provider.count_resident, provider.count_resident_many
            provider.count_resident = lambda layer, ids: rows.append(ids.shape[0]) or count_one(layer, ids)
            provider.count_resident_many = lambda routed: rows.extend(i.shape[0] for _, i in routed) or count_many(routed)
            vocab = engine.args.vocab_size
            before = engine.expert_stats()
            engine.prefill([(7 * i + 3) % vocab for i in range(23)])
            after = engine.expert_stats()
            hits[mode] = (after["hits"] - before["hits"], after["misses"] - before["misses"])
            counted[mode] = rows
            assert engine.experts.booked is None and engine.experts.tile_tokens is None
        finally:
            engine.close()
    layers = len(engine.provider.moe_layers)
    assert counted["off"] == [23] * layers and counted["on"] == [23] * layers  # never the 32 padded rows
    assert hits["on"] == hits["off"] and hits["off"][0] > 0 and hits["off"][1] == 0


def test_the_hit_counter_is_kept_and_zeroed_when_read(tiny_packed_model):
    """Reading the resident hits zeroes the device counter in place rather than dropping it: work
    queued or captured earlier may still add into its memory."""
    engine = load(tiny_packed_model("qwen3_moe", "q4"), "off")
    try:
        provider = engine.provider
        layer = provider.moe_layers[0]
        ids = torch.tensor([[0, 1], [1, 2], [2, 0]])  # three distinct experts
        provider.count_resident(layer, ids)
        counter = provider._device_hits
        before = engine.expert_stats()["hits"]
        assert provider._device_hits is counter and int(counter.sum()) == 0
        provider.count_resident_many([(layer, ids), (provider.moe_layers[1], torch.tensor([[0, 1]] * 3))])
        assert engine.expert_stats()["hits"] - before == 3 + 2
        assert provider._device_hits is counter and int(counter.sum()) == 0
    finally:
        engine.close()


def test_one_graph_serves_every_sequence_slot(tiny_packed_model):
    """The rows' sequence is a static input of the graph: its key names no slot."""
    engine = load(tiny_packed_model("qwen3_moe", "q4"), "on", max_sequences=2)
    try:
        graphs = engine.prefill_graphs
        assert graphs._key(23) == graphs._key(30) and graphs._key(23)[0] == 32
        # every slot's fresh prompts are padded (the bits must not depend on the slot); the CPU captures none
        assert graphs.takes(23, 0, 0) and graphs.takes(23, 0, 1) and not graphs.replays()
        graphs.broken = True  # a capture failed once: the padded chunks run eagerly, still padded
        assert graphs.takes(23, 0, 0)
    finally:
        engine.close()


def test_the_padding_rows_take_the_last_real_rows_experts():
    ids = torch.tensor([[0, 1], [2, 3], [4, 5], [6, 7], [8, 9]])
    got = padding_on_last_row(ids, torch.tensor([2]))
    assert got.tolist() == [[0, 1], [2, 3], [4, 5], [4, 5], [4, 5]]
    assert padding_on_last_row(ids, torch.tensor([4])).tolist() == ids.tolist()


def prefill_logits(engine: Engine, n: int, *, seq: int = 0) -> torch.Tensor:
    """A fresh prompt's logits (every slot emptied first: a reused start would not be padded)."""
    vocab = engine.args.vocab_size
    for cache in engine.caches:
        cache.release()
    engine.pool.forget_published()
    logits, _ = engine.prefill([(7 * i + 3) % vocab for i in range(n)], seq=seq)
    return logits.clone()


@pytest.mark.parametrize("cache_size", ["min", "50%"])
def test_padded_prefill_has_the_same_bits_at_every_cache_size_and_reads_no_padding_expert(cache_size,
                                                                                        tiny_packed_model):
    """A streamed chunk is padded as the resident one is (a graph needs every expert resident; the
    padding changes the last bits, so it must not depend on the cache), and its padding rows read no
    expert the real rows did not."""
    packed = tiny_packed_model("qwen3_moe", "q4")
    resident = load(packed, "on")
    try:
        resident_on_cpu(resident)
        expected = {n: prefill_logits(resident, n) for n in (23, 100)}
    finally:
        resident.close()
    streamed = load(packed, "on", **{"cache_size": cache_size})
    try:
        assert not streamed.experts.resident
        seen = []
        plan = streamed.experts.plan
        streamed.experts.plan = lambda layer, x, ids, w, **kw: seen.append(ids.clone()) or plan(layer, x, ids, w, **kw)
        for n in (23, 100):
            seen.clear()
            assert torch.equal(prefill_logits(streamed, n), expected[n])
            assert seen and all(ids.shape[0] == bucket(n) for ids in seen)
            assert all(set(ids.unique().tolist()) == set(ids[:n].unique().tolist()) for ids in seen)
    finally:
        streamed.close()


def test_every_sequence_slot_pads_its_fresh_prompt(tiny_packed_model):
    """The second slot's prompt gets the first slot's bits (padded too, though it replays no graph)."""
    engine = load(tiny_packed_model("qwen3_moe", "q4"), "on", max_sequences=2)
    try:
        second = engine.open_sequence()
        assert second != 0
        assert torch.equal(prefill_logits(engine, 40, seq=second), prefill_logits(engine, 40, seq=0))
    finally:
        engine.close()


def test_a_bucket_is_captured_only_where_its_workspace_fits(tiny_packed_model, monkeypatch):
    """A graph keeps its activations beside the eager prefill's: too little free memory leaves the
    bucket eager (padded: the same bits), said once."""
    engine = load(tiny_packed_model("qwen3_moe", "q4"), "on")
    try:
        graphs = PrefillGraphs(engine.model, engine.experts, engine.pool, largest=256, capture=False,
                               workspace=lambda tokens: tokens * 1000)
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (50_000, 10 ** 9))
        monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 20_000)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 5_000)
        assert graphs._room(64)  # 64,000 needed, 65,000 free (50,000 + 15,000 cached unused)
        assert not graphs._room(128) and graphs._short == {128}
        assert PrefillGraphs(engine.model, engine.experts, engine.pool, largest=256, capture=False)._room(2048)
    finally:
        engine.close()
