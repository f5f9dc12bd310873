"""The CPU's share of the misses on the device-driven path (moestream.cpu_share.share), on
CUDA: every decode step one CUDA graph, the device withholding a share of each layer's misses and
waiting on the CPU worker's answer in pinned RAM. Fed no share's greedy tokens, a share's
log-probabilities are within the dtype's tolerance of no share's over 24 steps (the CPU kernels round
unlike the device's, so a near-tied greedy choice may differ and free-running tokens part ways: the
contract is the tolerance, as on the host path); a failing or late CPU gives the bits of no share
(the graph computes the withheld experts itself); a share that withholds nothing posts nothing and
gives the bits of no share; `auto` set to nothing rises again through its probes; the Triton lookup
withholds what the torch rule withholds; an error inside the native worker gives the bits of no
share."""
import pytest
import torch

from moestream.cpu_share import share as share_module
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from test_decoder import greedy_or_forced
from moestream.experts.device_map import DeviceMap, copy_records
from moestream.experts.uva import device_view

pytestmark = pytest.mark.gpu
PROMPT = "def fibonacci(n):\n    if n < 2:"
STEPS = 24
TOLERANCE = {"bfloat16": 0.15, "float32": 0.05}  # the README's bf16 figure; float32: the CPU's int kernels


@pytest.fixture(scope="module")
def packed(tiny_packed_model):
    return tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16", num_hidden_layers=5, num_experts_per_tok=4)


def run(packed, dtype="bfloat16", fault_after=None, fault_delay_s=0.0, forced=None, before=None, cpu_experts="off",
        **opts):
    """Greedy tokens and their log-probabilities, or with `forced` those tokens fed one step at a time.
    before(engine): called once streaming has started, before the first step."""
    options = EngineOptions(device="cuda", dtype=dtype, max_context=256, cache_size="50%", host_cache_size="all",
                            cpu_experts=cpu_experts, **opts)
    engine = Engine.load(packed, options=options, streaming="device")
    try:
        engine._make_resident()  # streaming (and the share with it) starts here
        if engine.experts.cpu_share is not None:
            engine.experts.cpu_share.set_faults(fault_after, fault_delay_s)
        if before is not None:
            before(engine)
        prompt = engine.tokenizer.encode(PROMPT)
        tokens, logprobs = greedy_or_forced(engine, prompt, STEPS, forced)
        assert engine.streaming == "device"
        assert ("step", 1) in engine.decoder.graphs, "decode steps ran as one CUDA graph each"
        return tokens, logprobs, engine.expert_stats()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def off(packed):
    return {dtype: run(packed, dtype) for dtype in ("bfloat16", "float32")}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("share", ["0.5", "1", "auto"])
def test_a_share_gives_the_log_probs_of_no_share_within_the_tolerance(packed, off, share, dtype):
    ref_tokens, ref_logprobs, ref_stats = off[dtype]
    _, logprobs, stats = run(packed, dtype, cpu_experts=share, forced=ref_tokens)
    assert ref_stats["hit_rate"] < 1.0, "the 50 % cache should stream"
    assert len(logprobs) == STEPS
    assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs)) < TOLERANCE[dtype]
    assert stats["cpu_fallbacks"] == 0 and stats["cpu_late_calls"] == 0 and stats["cpu_errors"] == 0
    if share != "auto":
        assert stats["cpu_experts"] > 0 and stats["cpu_gb_s"] > 0


def test_a_failing_cpu_gives_the_bits_of_no_share(packed, off):
    tokens, logprobs, stats = run(packed, cpu_experts="1", fault_after=0)
    assert (tokens, logprobs) == off["bfloat16"][:2]
    assert stats["cpu_errors"] > 0 and stats["cpu_fallbacks"] > 0 and stats["cpu_experts"] == 0


def test_a_late_cpu_gives_the_bits_of_no_share(packed, off, monkeypatch):
    monkeypatch.setattr(share_module, "TIMEOUT_S", 0.0005)
    tokens, logprobs, stats = run(packed, cpu_experts="1", fault_delay_s=0.01)
    assert (tokens, logprobs) == off["bfloat16"][:2]
    assert stats["cpu_late_calls"] > 0 and stats["cpu_fallbacks"] > 0


def test_an_empty_share_posts_nothing_and_gives_the_bits_of_no_share(packed, off):
    tokens, logprobs, stats = run(packed, cpu_experts="0")
    assert (tokens, logprobs) == off["bfloat16"][:2]
    assert stats["cpu_jobs"] == 0 and stats["cpu_experts"] == 0  # the worker never saw a call
    assert stats["cpu_empty_calls"] > 0 and stats["cpu_late_calls"] == 0 and stats["cpu_fallbacks"] == 0


def slow_link_and_no_share(engine):
    ds = engine.experts.cpu_share
    assert ds.copy_timed and ds.copy_gb_s > 0  # the copies were timed at start
    ds.tuner.copy_gb_s = 1e-4  # as if the link crawled: the CPU should take every miss it may
    ds._set_share(0)  # a share that gives the CPU nothing ...
    ds.share[1] = 4  # ... but a probe every 4 lookups


def test_auto_rises_from_nothing_through_its_probes(packed, off):
    _, logprobs, stats = run(packed, cpu_experts="auto", forced=off["bfloat16"][0],
                             before=slow_link_and_no_share)
    assert stats["cpu_jobs"] > 2 and stats["cpu_late_calls"] == 0 and stats["cpu_fallbacks"] == 0
    assert stats["cpu_share_now"] > 0.5 and stats["cpu_kernel_gb_s_ema"] > 0 and stats["cpu_handover_us_ema"] > 0
    assert stats["cpu_experts"] > stats["cpu_jobs"]  # after the probes, jobs of more than one expert
    assert max(abs(a - b) for a, b in zip(logprobs, off["bfloat16"][1])) < TOLERANCE["bfloat16"]


def lose_the_record_addresses(engine):
    ds = engine.experts.cpu_share
    ds.native._keep[1].zero_()  # every record "not in host RAM": each job fails inside the native code


def test_an_error_inside_the_native_worker_gives_the_bits_of_no_share(packed, off):
    tokens, logprobs, stats = run(packed, cpu_experts="1", before=lose_the_record_addresses)
    assert (tokens, logprobs) == off["bfloat16"][:2]
    assert stats["cpu_errors"] > 0 and stats["cpu_experts"] == 0
    assert stats["cpu_fallbacks"] > 0


def test_some_failures_mix_cpu_rows_and_fallbacks(packed, off):
    _, logprobs, stats = run(packed, cpu_experts="1", fault_after=20, forced=off["bfloat16"][0])
    assert max(abs(a - b) for a, b in zip(logprobs, off["bfloat16"][1])) < TOLERANCE["bfloat16"]
    assert stats["cpu_experts"] > 0 and stats["cpu_fallbacks"] > 0


def test_the_triton_lookup_withholds_what_the_torch_rule_withholds():
    layers, experts, width = (0, 1), 64, 1024
    keys = [(layer, e) for layer in layers for e in range(experts)]
    host = torch.randint(0, 256, (len(keys), width), dtype=torch.uint8).pin_memory()
    share = torch.tensor([600], dtype=torch.int32, device="cuda")
    maps = [DeviceMap(torch.zeros((140, width), dtype=torch.uint8, device="cuda"), device_view(host),
                      {k: i for i, k in enumerate(keys)}, {l: experts for l in layers}, {l: width for l in layers})
            for _ in range(2)]
    g = torch.Generator().manual_seed(5)
    for step in range(200):
        layer = layers[step % 2]
        ids = torch.stack([torch.randperm(experts, generator=g)[:8] for _ in range(1 + 3 * (step % 7 == 0))]).cuda()
        maps[0].ensure(layer, ids, withhold=share, count=step % 5 != 0)  # the Triton program
        src, dst, todo = maps[1].decide(layer, ids, withhold=share, count=step % 5 != 0)  # the torch rule
        copy_records(maps[1].host_pool, maps[1].pool, src, dst, todo)
        for name in ("table", "owner", "last_used", "clock", "hits", "misses", "away", "pool"):
            assert torch.equal(getattr(maps[0], name), getattr(maps[1], name)), (step, name)
    assert int(maps[0].away.sum()) > 0
