"""The expert cache never changes the answer: identical tokens and logprobs (bitwise on CPU) for
every cache size, policy, source and host tier; plus its statistics, faults and sizing."""
import itertools
import shutil

import numpy as np
import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import ExpertReadError, MoestreamError
from moestream.experts.trace import RoutingTrace

FAMILY = "qwen3_moe"


def run(model, prompt=None, *, max_new=12, prefetch=True, **opts):
    engine = Engine.load(model, options=EngineOptions(device="cpu", prefill_chunk_tokens=5, **opts), prefetch=prefetch)
    prompt = prompt or engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    gen = engine.generate(prompt, max_new_tokens=max_new, logprobs=4)
    events = list(gen)
    engine.close()
    return [(e.token_id, e.top_logprobs) for e in events], gen.result.receipt


@pytest.fixture(scope="module")
def model(tiny_packed_model):
    return tiny_packed_model(FAMILY, "q4")


@pytest.fixture(scope="module")
def reference(model):
    return run(model, cache_size="all")[0]


@pytest.mark.parametrize("size,policy,source", list(itertools.product(
    ["min", "3", "25%", "50%", "all"], ["clock", "lru", "arc", "lfu"], ["direct", "mmap"])))
def test_same_tokens_and_logprobs_for_every_size_policy_and_source(model, reference, size, policy, source):
    cache_size = size if not size.isdigit() else str(int(size) * 8192)  # bytes: 3 slots of 8 KiB
    out, receipt = run(model, cache_size=cache_size, cache_policy=policy, expert_source=source)
    assert out == reference  # bitwise: same floats
    if size in ("min", "3", "25%"):
        assert receipt["hit_rate"] < 1.0 and receipt["misses"] > 0
        assert receipt["bytes_read_disk"] + receipt["bytes_read_host"] > 0  # mmap: the page cache may hold it all


@pytest.mark.parametrize("host", ["25%", "all"])
def test_host_tier_does_not_change_the_answer(model, reference, host):
    out, receipt = run(model, cache_size="min", host_cache_size=host)
    assert out == reference
    assert receipt["bytes_read_host"] > 0


def test_host_tier_reads_each_expert_from_disk_once(model):
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="min", host_cache_size="all"))
    prompt = engine.tokenizer.encode("import os\nimport sys\n")
    first = engine.generate(prompt, max_new_tokens=10)
    list(first)
    disk_after_first = engine.provider.stats()["bytes_read_disk"]
    record = engine.provider.slot_bytes
    assert disk_after_first <= engine.provider.total_experts * record
    second = engine.generate(prompt, max_new_tokens=10)
    list(second)
    assert second.result.receipt["bytes_read_disk"] == 0  # everything came from the host tier
    assert second.result.receipt["bytes_read_host"] > 0


@pytest.mark.parametrize("host", ["all", "5"])
def test_filling_the_host_tier_reads_what_it_holds_once(model, reference, host):
    host_size = host if host == "all" else str(int(host) * 8192)  # 5 slots of 8 KiB
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="min", host_cache_size=host_size,
                                                      prefill_chunk_tokens=5))
    total, held = engine.provider.total_experts, engine.provider.host.slots
    assert engine.provider.fill_host_tier() == min(total, held)
    assert engine.provider.fill_host_tier() == 0  # nothing left to read
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    gen = engine.generate(prompt, max_new_tokens=12, logprobs=4)
    assert [(e.token_id, e.top_logprobs) for e in gen] == reference
    if host == "all":
        assert gen.result.receipt["bytes_read_disk"] == 0 and gen.result.receipt["bytes_read_host"] > 0
    engine.close()


@pytest.mark.parametrize("size", ["min", "25%"])
def test_next_layer_prefetch_changes_nothing_but_the_reads(model, reference, size):
    out, receipt = run(model, cache_size=size)
    assert out == reference
    stats = receipt["experts"]
    assert 0 <= stats["prefetch_used"] <= stats["prefetch_issued"]
    if size != "min":  # at the floor every slot is pinned by the layer computing: no room for guesses
        assert stats["prefetch_issued"] > 0
    out, receipt = run(model, cache_size=size, prefetch=False)
    assert out == reference and receipt["experts"]["prefetch_issued"] == 0


def test_prefetch_guesses_come_from_the_next_layers_router(model):
    """The predictor asks for exactly the next MoE layer's router top-k on this layer's expert input
    (of a streamed model: with every expert resident no layer fetches, so none guesses)."""
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="50%"))
    asked = []
    engine.provider.prefetch = lambda layer, experts: asked.append((layer, list(experts))) or 0
    prompt = engine.tokenizer.encode("x = 1")
    list(engine.generate(prompt, max_new_tokens=3))
    moe_layers = [layer.ffn.layer for layer in engine.model.layers if hasattr(layer.ffn, "router")]
    assert asked and {layer for layer, _ in asked} == set(moe_layers[1:])
    top_k = engine.args.num_experts_per_tok
    assert all(len(experts) == top_k and experts == sorted(experts) for _, experts in asked)
    engine.close()


def test_auto_policy_keeps_often_routed_experts_when_the_pool_is_below_one_tokens_experts():
    """The demo model (trained: real routing) at 10 %: 26 slots for the 32 (layer, expert) pairs one
    token touches. CLOCK evicts each expert just before its next use and hits nothing; "auto" picks
    LFU, which keeps the often-routed experts. Same tokens either way."""
    from moestream.engine.engine import DEMO_MODEL

    outs = {}
    for policy in ("clock", "auto"):
        engine = Engine.load(DEMO_MODEL, options=EngineOptions(device="cpu", cache_size="10%", cache_policy=policy),
                             prefetch=False)
        prompt = engine.tokenizer.encode("import os\nimport sys\n\ndef main():\n")
        gen = engine.generate(prompt, max_new_tokens=24, stop_at_eos=False)
        outs[policy] = ([e.token_id for e in gen], gen.result.receipt)
        engine.close()
    assert outs["clock"][0] == outs["auto"][0]
    assert outs["auto"][1]["experts"]["policy"] == "lfu" and outs["clock"][1]["experts"]["policy"] == "clock"
    assert outs["clock"][1]["hit_rate"] < 0.05 < 0.15 < outs["auto"][1]["hit_rate"]


def test_auto_policy_is_clock_where_the_pool_holds_a_tokens_experts():
    from moestream.engine.plan import resolve_policy

    assert resolve_policy("auto", slots=32, working_set=32) == "clock"
    assert resolve_policy("auto", slots=31, working_set=32) == "lfu"
    assert resolve_policy("arc", slots=3, working_set=32) == "arc"


def test_receipt_fields_and_per_layer_hit_rate(model):
    _, receipt = run(model, cache_size="min")
    experts = receipt["experts"]
    assert set(experts["hit_rate_per_layer"]) == {"0", "2"}
    assert experts["slots"] == 2
    assert receipt["memory"]["expert_slots"] == 2 * 8192
    assert receipt["read_wait_s"] >= 0


def test_a_miss_the_page_cache_holds_is_read_on_the_computing_thread(model, reference, monkeypatch):
    """The CPU's default source (mmap): a record whose pages this process holds is copied (and
    checked) where the step waits for it, never handed to a reader thread; the answer is the same."""
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="min", prefill_chunk_tokens=5),
                         prefetch=False)
    assert engine.provider.source.name == "mmap"
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    assert [(e.token_id, e.top_logprobs) for e in engine.generate(prompt, max_new_tokens=12, logprobs=4)] == reference
    handed = []
    monkeypatch.setattr(engine.provider.source, "submit", lambda *a: handed.append(a))  # every page touched now
    before = engine.provider.stats()["misses"]
    engine.reset()
    again = engine.generate(prompt, max_new_tokens=12, logprobs=4)
    assert [(e.token_id, e.top_logprobs) for e in again] == reference
    assert engine.provider.stats()["misses"] > before and not handed
    engine.close()


def test_io_error_mid_read_fails_that_request_and_the_next_one_works(model, reference, monkeypatch):
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="min", prefill_chunk_tokens=5,
                                                      expert_source="direct"))
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    source = engine.provider.source
    real_submit = source.submit
    calls = {"n": 0}

    def failing_submit(layer, expert, dest):
        calls["n"] += 1
        if calls["n"] == 5:
            from concurrent.futures import Future
            f = Future()
            f.set_exception(ExpertReadError(f"reading layer {layer} expert {expert}: [Errno 5] Input/output error"))
            return f
        return real_submit(layer, expert, dest)

    monkeypatch.setattr(source, "submit", failing_submit)
    with pytest.raises(ExpertReadError, match="Input/output error"):
        list(engine.generate(prompt, max_new_tokens=12, logprobs=4))
    again = engine.generate(prompt, max_new_tokens=12, logprobs=4)
    assert [(e.token_id, e.top_logprobs) for e in again] == reference


def test_a_corrupt_record_is_named_by_default(model, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(model, bad)
    path = bad / "experts-002.bin"
    data = bytearray(path.read_bytes())
    data[3 * 8192 + 100] ^= 0xFF  # layer 2, expert 3
    path.write_bytes(bytes(data))
    # the file size is right, so it loads; the checksum finds the record when it is read
    engine = Engine.load(bad, options=EngineOptions(device="cpu", cache_size="all"), digest_dir=str(tmp_path))
    with pytest.raises(ExpertReadError, match=r"layer 2 expert 3"):
        engine.provider.fetch(2, list(range(8)))
    records = engine.provider.fetch(2, [0, 1, 2, 4])  # the others still load
    engine.provider.release(2)
    assert set(records) == {0, 1, 2, 4}


def test_truncated_expert_file_is_refused_at_load(model, tmp_path):
    bad = tmp_path / "trunc"
    shutil.copytree(model, bad)
    path = bad / "experts-000.bin"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(MoestreamError, match="experts-000.bin"):
        Engine.load(bad, options=EngineOptions(device="cpu"))


def test_memory_budget_sizes_slots_or_names_the_minimum(model):
    engine = Engine.load(model, options=EngineOptions(device="cpu", memory_budget="512MiB", max_context=128))
    assert engine.plan.slots == engine.plan.total_experts  # small model: everything fits
    with pytest.raises(MoestreamError, match="needs at least"):
        Engine.load(model, options=EngineOptions(device="cpu", memory_budget="10KB", max_context=128))
    # on the CPU the budget is the process's RAM: the process itself is a row, so a budget that holds
    # the model's tensors but not the interpreter and torch is refused, naming it
    ledger = engine.plan.ledger
    tensors = ledger.device_total - ledger.runtime
    assert ledger.runtime > 0
    with pytest.raises(MoestreamError, match="runtime"):
        Engine.load(model, options=EngineOptions(device="cpu", memory_budget=str(tensors * 2), max_context=128))


def test_cache_size_below_the_floor_is_refused(model):
    with pytest.raises(MoestreamError, match="minimum is 2"):
        Engine.load(model, options=EngineOptions(device="cpu", cache_size="8KiB"))


def test_trace_routing_records_every_token_and_layer(model, tmp_path):
    path = tmp_path / "trace.npz"
    engine = Engine.load(model, options=EngineOptions(device="cpu", trace_routing=str(path)))
    prompt = engine.tokenizer.encode("def f(x):")
    gen = engine.generate(prompt, max_new_tokens=6)
    n = len(list(gen))
    trace = RoutingTrace.load(path)
    tokens = len(prompt) + n - 1  # the last generated token is never run through the model
    assert len(trace) == tokens * 2  # two MoE layers
    assert trace.experts.shape[1] == 2 and trace.experts.max() < 8
    assert sorted(set(trace.layer.tolist())) == [0, 2]
    assert np.array_equal(np.unique(trace.position), np.arange(tokens))


def test_the_digest_cache_dir_comes_from_the_command_never_the_library(model, tmp_path, monkeypatch):
    from moestream.commands.engine_args import digest_dir
    from moestream.commands.engine_args import CACHE_DIR_ENV

    assert digest_dir({CACHE_DIR_ENV: "/given"}) == "/given" and digest_dir({}) is None
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path / "elsewhere"))  # the library reads no environment
    copy = tmp_path / "model"  # files this process has not hashed yet
    shutil.copytree(model, copy)
    engine = Engine.load(copy, options=EngineOptions(device="cpu", cache_size="min"), digest_dir=str(tmp_path / "given"))
    engine.close()
    assert (tmp_path / "given").is_dir() and not (tmp_path / "elsewhere").exists()
