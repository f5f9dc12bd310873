"""--cpu-experts: the CPU kernels against the torch reference per expert (4 and 8 bits), an engine
with a CPU share within tolerance of the reference, fail-closed fallbacks (errors and timeouts give
the tokens of off), layouts the CPU refuses, one-line errors for bad values; every host-tier record
repacked once before the first step (never in a step), what the ledger predicts, and only what fits
where RAM is short."""
import logging
import subprocess
import sys
import threading

import pytest
import torch

from cpu_share_run import PROMPT, run_with_share
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.records import RecordField
from moestream.kernels.cpu_experts import INT8_METHODS, refusal, repack, repacked_nbytes
from moestream.kernels.reference import expert_ffn
from moestream.layers import cpu_share
from moestream.layers.cpu_share import parse_share
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")
LOGPROB_TOLERANCE = 1e-3  # float32: the CPU kernels round differently from the reference, not more


def make_record(hidden, inter, bits, group=64, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rec = {}
    for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
        w, s, b = quantize(torch.randn(rows, cols, generator=g).to(dtype), bits, group)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec, {p: QuantSpec(bits, group) for p in PROJS}


def fields_of(rec):
    names = {torch.int32: "U32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
    return [RecordField(name, names[t.dtype], list(t.shape), 0, t.nbytes) for name, t in rec.items()]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("method", INT8_METHODS)
@pytest.mark.parametrize("hidden,inter,group", [(128, 64, 64), (192, 96, 32), (384, 128, 128)])
def test_cpu_kernel_matches_the_reference_per_expert(bits, method, hidden, inter, group):
    rec, quant = make_record(hidden, inter, bits, group, seed=bits + hidden)
    assert refusal(fields_of(rec), quant) is None
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(1))
    ref = expert_ffn(x, rec, quant)  # float32
    y = repack(rec, quant, torch.float32, int8_method=method).ffn(x)
    assert y.dtype == torch.float32 and y.shape == ref.shape
    assert torch.allclose(y, ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item())
    # bf16 activations: within bf16 rounding of the bf16 reference
    ref16 = expert_ffn(x.bfloat16(), rec, quant).float()
    y16 = repack(rec, quant, torch.bfloat16, int8_method=method).ffn(x.bfloat16()).float()
    assert (y16 - ref16).abs().max() <= 0.03 * ref16.abs().max()
    # one token's row does not depend on how many rows are computed together... (per pair in use)
    one = repack(rec, quant, torch.float32, int8_method=method).ffn(x[1:2])
    assert torch.allclose(one[0], y[1], rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("method", INT8_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_weighted_row_in_place_has_the_bits_of_ffn(bits, method, dtype):
    rec, quant = make_record(256, 128, bits, seed=3)
    expert = repack(rec, quant, dtype, int8_method=method)
    x = torch.randn(1, 256, generator=torch.Generator().manual_seed(2)).to(dtype)
    weight = torch.tensor(0.3173, dtype=torch.float32)
    out = torch.full((256,), float("nan"))
    expert.weighted_row_into(x, out, float(weight))
    assert torch.equal(out, expert.ffn(x)[0].float() * weight)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("method", INT8_METHODS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_repacked_bytes_are_known_before_repacking(bits, method, dtype):
    rec, quant = make_record(192, 96, bits, 32)
    kept = repack(rec, quant, dtype, int8_method=method).nbytes
    assert repacked_nbytes(fields_of(rec), quant, dtype, int8_method=method) == kept


def test_refused_layouts_say_why():
    rec, quant = make_record(128, 64, 4)
    fields = fields_of(rec)
    assert "SwiGLU only" in refusal(fields, {p: QuantSpec(4, 64, "gelu_tanh") for p in PROJS})
    assert "group size 16" in refusal(fields, {p: QuantSpec(4, 16) for p in PROJS})
    assert "2-bit" in refusal(fields, {p: QuantSpec(2, 64) for p in PROJS})
    assert "not quantized" in refusal(fields, {p: QuantSpec() for p in PROJS})
    # 40 output rows (a layout no quantizer here makes, but a record could hold): torch's int4
    # packing takes multiples of 16
    odd = [RecordField(f.name, f.dtype, [40, f.shape[1]] if f.name.startswith("gate_proj") else f.shape, 0, 0)
           for f in fields]
    assert "multiple of 16" in refusal(odd, quant)


@pytest.mark.parametrize("bad", ["1.5", "-0.1", "half", "nan", ""])
def test_parse_share_refuses_bad_values(bad):
    with pytest.raises(ValueError):
        parse_share(bad)
    assert parse_share("AUTO") == "auto" and parse_share("0.25") == 0.25 and parse_share("off") == "off"


@pytest.fixture(scope="module")
def model(tiny_packed_model):
    return tiny_packed_model("qwen3_moe", "q4")


def run(model, steps=12, fault_after=None, fault_delay_s=0.0, **opts):
    return run_with_share(model, steps, fault_after, fault_delay_s, **opts)[:4]


@pytest.fixture
def repack_threads(monkeypatch):
    """The names of the threads that repacked, one per repack."""
    names = []
    real = cpu_share.repack

    def counting(*args, **kwargs):
        names.append(threading.current_thread().name)
        return real(*args, **kwargs)

    monkeypatch.setattr(cpu_share, "repack", counting)
    return names


@pytest.mark.parametrize("share", ["1", "auto"])
def test_every_host_tier_record_is_repacked_up_front_and_never_in_a_step(model, reference, repack_threads, share):
    tokens, logprobs, stats, receipt = run(model, cpu_experts=share)
    total = stats["total_experts"]
    assert stats["host_slots"] == total
    assert stats["cpu_repacked_experts"] == stats["cpu_repacks"] == total  # every eligible record, once
    assert len(repack_threads) == total
    assert all(name.startswith("moestream-repack") for name in repack_threads)  # the up-front pool, not a step
    assert stats["cpu_repack_workers"] >= 1 and stats["cpu_repack_left_out"] == 0 and stats["cpu_not_repacked"] == 0
    assert stats["cpu_experts"] > 0 and stats["cpu_fallbacks"] == 0
    assert receipt["memory"]["cpu_repacked"] == stats["cpu_repacked_bytes"] > 0  # the ledger knew it
    assert tokens == reference[0]
    assert max(abs(a - b) for a, b in zip(logprobs, reference[1])) < LOGPROB_TOLERANCE


def test_decode_steps_repack_nothing(model, repack_threads):
    options = EngineOptions(device="cpu", cache_size="min", host_cache_size="all", cpu_experts="1")
    engine = Engine.load(model, options=options)
    try:
        engine.prefill(engine.tokenizer.encode(PROMPT))
        before = engine.expert_stats()
        assert before["cpu_repacks"] == before["total_experts"]
        for _ in engine.generate(engine.tokenizer.encode("def f("), max_new_tokens=8, stop_at_eos=False):
            pass
        after = engine.expert_stats()
    finally:
        engine.close()
    assert after["cpu_repacks"] == before["cpu_repacks"] and len(repack_threads) == before["cpu_repacks"]
    assert after["cpu_experts"] > before["cpu_experts"]


def test_short_of_ram_it_repacks_what_fits_and_says_so(model, reference, monkeypatch, caplog):
    probe = Engine.load(model, options=EngineOptions(device="cpu", cache_size="min", host_cache_size="all",
                                                      cpu_experts="1"))
    each, total = max(probe.experts.cpu.repacked_bytes_each.values()), probe.provider.total_experts
    probe.close()
    fit = total // 2
    monkeypatch.setattr(cpu_share, "available_ram", lambda: cpu_share.RAM_KEPT_FREE + fit * each + each // 2)
    with caplog.at_level(logging.WARNING, logger="moestream.layers.cpu_share"):
        tokens, logprobs, stats, _ = run(model, cpu_experts="1")
    assert stats["cpu_repacked_experts"] == stats["cpu_repacks"] == fit
    assert stats["cpu_repack_left_out"] == total - fit
    assert stats["cpu_not_repacked"] > 0 and stats["cpu_fallbacks"] == 0
    assert any(f"RAM for {fit} of the {total} experts" in r.getMessage() for r in caplog.records)
    assert tokens == reference[0]
    assert max(abs(a - b) for a, b in zip(logprobs, reference[1])) < LOGPROB_TOLERANCE


def test_a_partial_host_tier_repacks_its_records(model, reference, repack_threads):
    tokens, logprobs, stats, receipt = run(model, cpu_experts="1", host_cache_size="50%")
    assert 0 < stats["host_slots"] < stats["total_experts"]
    assert stats["cpu_repacks"] == stats["host_slots"] == len(repack_threads)  # filled up front, then repacked
    assert receipt["memory"]["cpu_repacked"] == stats["cpu_repacked_bytes"]
    assert tokens == reference[0]
    assert max(abs(a - b) for a, b in zip(logprobs, reference[1])) < LOGPROB_TOLERANCE


def test_without_a_host_tier_the_cpu_gets_nothing(model, reference, caplog):
    with caplog.at_level(logging.WARNING, logger="moestream.engine.expert_setup"):
        tokens, logprobs, stats, _ = run(model, cpu_experts="1", host_cache_size="0")
    assert stats["cpu_repacks"] == 0 and stats["cpu_experts"] == 0
    assert any("no host tier" in r.getMessage() for r in caplog.records)
    assert tokens == reference[0] and logprobs == reference[1]  # every expert on the device: the bits of off


def test_the_worker_has_its_own_threads_and_the_callers_stay(model):
    saved = torch.get_num_threads()  # the other tests' bits depend on it: given back below
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="min", host_cache_size="all",
                                                       cpu_experts="1", threads=1))
    try:
        assert engine.experts.cpu.threads == 1  # the engine's --threads
        torch.set_num_threads(2)  # the caller changes its own count after loading
        for _ in engine.generate(engine.tokenizer.encode(PROMPT), max_new_tokens=3, stop_at_eos=False):
            pass
        assert torch.get_num_threads() == 2  # neither the repack pool (1 each) nor the worker changed it
        assert engine.expert_stats()["cpu_experts"] > 0
        assert engine.experts.cpu._executor.submit(torch.get_num_threads).result() == 1  # the worker's own
    finally:
        engine.close()
        torch.set_num_threads(saved)


def test_available_ram_reads_proc_meminfo_without_psutil(monkeypatch):
    with_psutil = cpu_share.available_ram()
    monkeypatch.setitem(sys.modules, "psutil", None)  # import psutil now fails
    without = cpu_share.available_ram()
    assert without > 0 and abs(without - with_psutil) < 0.5 * with_psutil


@pytest.fixture(scope="module")
def reference(model):
    return run(model)


@pytest.mark.parametrize("share", ["0.5", "1", "auto"])
def test_engine_with_a_cpu_share_stays_within_tolerance(model, reference, share):
    tokens, logprobs, stats, receipt = run(model, cpu_experts=share)
    assert tokens == reference[0]
    assert max(abs(a - b) for a, b in zip(logprobs, reference[1])) < LOGPROB_TOLERANCE
    assert stats["cpu_fallbacks"] == 0
    assert stats["cpu_experts"] > 0 and stats["cpu_pairs"] >= stats["cpu_experts"]
    assert stats["cpu_gb_s"] > 0 and stats["cpu_repacks"] > 0
    assert stats["cpu_repacked_bytes"] > 0
    assert receipt["experts"]["cpu_share"] == parse_share(share)
    assert "cpu_experts" not in reference[2]  # off: nothing of the CPU share exists


def test_a_half_share_gives_the_cpu_about_half_the_misses(model):
    half = run(model, cpu_experts="0.5")[2]
    full = run(model, cpu_experts="1")[2]
    assert 0 < half["cpu_experts"] < full["cpu_experts"]


def test_cpu_errors_fall_back_to_the_device_with_the_tokens_of_off(model, reference):
    tokens, logprobs, stats, _ = run(model, cpu_experts="1", fault_after=0)
    assert tokens == reference[0]
    assert logprobs == reference[1]  # every expert computed on the device: the bits of off
    assert stats["cpu_experts"] == 0 and stats["cpu_errors"] > 0
    assert stats["cpu_fallbacks"] >= stats["cpu_errors"]


def test_a_fault_after_some_jobs_mixes_cpu_and_fallbacks(model, reference):
    tokens, logprobs, stats, _ = run(model, cpu_experts="1", fault_after=3)
    assert tokens == reference[0]
    assert max(abs(a - b) for a, b in zip(logprobs, reference[1])) < LOGPROB_TOLERANCE
    assert stats["cpu_experts"] > 0 and stats["cpu_fallbacks"] > 0


def test_a_cpu_timeout_falls_back_to_the_device(model, reference):
    tokens, logprobs, stats, _ = run(model, steps=4, cpu_experts="1", cpu_experts_timeout=0.01, fault_delay_s=0.2)
    assert tokens == reference[0][:4]
    assert logprobs == reference[1][:4]
    assert stats["cpu_timeouts"] > 0 and stats["cpu_fallbacks"] > 0
    assert stats["cpu_skipped_busy"] > 0  # no new share while a timed-out worker still runs


def test_refused_layout_never_goes_to_the_cpu(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "none")  # unquantized records
    tokens, _, stats, _ = run(packed, steps=4, cpu_experts="1")
    assert stats["cpu_experts"] == 0 and stats["cpu_refused_layers"]
    assert tokens == run(packed, steps=4)[0]


def test_bad_engine_option_is_a_clear_error(model):
    with pytest.raises(MoestreamError, match="cpu_experts"):
        Engine.load(model, options=EngineOptions(device="cpu", cpu_experts="2"))


@pytest.mark.parametrize("command", ["generate", "bench", "serve"])
@pytest.mark.parametrize("value,message", [("1.5", "between 0 and 1"), ("fast", "is not off, auto or a share")])
def test_bad_cli_values_give_one_line(command, value, message):
    proc = subprocess.run([sys.executable, "-m", "moestream", command, "--cpu-experts", value],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--cpu-experts" in lines[0] and message in lines[0], proc.stderr


def test_bench_json_and_generate_stats_line_report_the_cpu_share(model, tmp_path):
    import json

    out = tmp_path / "b.json"
    env = {**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "moestream", "bench", "--model", str(model), "--device", "cpu",
                           "--threads", "1", "--cache-sizes", "min", "--host-cache-size", "all", "--prefill-tokens", "8",
                           "--decode-tokens", "6", "--cpu-experts", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    run = json.loads(out.read_text())["runs"][0]
    assert run["cpu_experts"] == "1.0" and run["decode"]["cpu_experts"] > 0
    assert run["experts"]["cpu_gb_s"] > 0 and run["decode"]["cpu_fallbacks"] == 0
    proc = subprocess.run([sys.executable, "-m", "moestream", "generate", "--model", str(model), "--device", "cpu",
                           "--threads", "1", "--cache-size", "min", "--host-cache-size", "all", "--max-new", "6",
                           "--prompt", "def f(", "--cpu-experts", "0.5"], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0, proc.stderr
    assert "cpu experts" in proc.stderr and "fallbacks 0" in proc.stderr
