"""`moestream bench`: a cache-size sweep on the demo model as JSON (machine, exact command, speeds, hit
rates) and a PNG; the transformers comparison; one-line errors. Speeds are only checked to be positive."""
import contextlib
import io
import json
import os
import platform

import pytest
import torch

import moestream.bench.synth as synth_module
from moestream.commands.bench import main
from moestream.engine.engine import DEMO_MODEL
from moestream.format.reader import PackedModel

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not in the tree")


@pytest.fixture(autouse=True)
def keep_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)  # --threads sets the process-wide count


def run_bench(argv: list[str]) -> tuple[int, str, str]:
    """main(argv) as the `moestream` console script runs it: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("sys.argv", ["/usr/local/bin/moestream", "bench", *argv])
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = main(argv)
            except SystemExit as exc:  # a usage error (exit 2)
                code = exc.code
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """One warm sweep of the demo model over a 25 % and a 100 % device cache."""
    tmp = tmp_path_factory.mktemp("bench")
    argv = ["--device", "cpu", "--threads", "1", "--cache-sizes", "25%,100%", "--prefill-tokens", "16",
            "--prefill-repeats", "2", "--decode-tokens", "4", "--warmup", "--out", str(tmp / "OUT.json"), "--plot", str(tmp / "OUT.png"),
            "--heatmap", str(tmp / "HEAT.png")]
    before = torch.get_num_threads()
    try:
        code, out, err = run_bench(argv)
    finally:
        torch.set_num_threads(before)
    assert code == 0, err
    return {"argv": argv, "stdout": out, "json": json.loads((tmp / "OUT.json").read_text()), "png": tmp / "OUT.png",
            "heatmap": tmp / "HEAT.png"}


def test_machine_records_the_exact_command_and_platform(sweep):
    """The JSON names the machine and the command line that produced it."""
    machine = sweep["json"]["machine"]
    assert machine["command"] == "moestream bench " + " ".join(sweep["argv"])
    assert machine["platform"] == platform.platform()
    assert machine["python"] == platform.python_version()
    assert machine["torch"] == torch.__version__
    assert machine["cpu_count"] == os.cpu_count()
    assert isinstance(machine["cpu"], str) and machine["cpu"]
    assert ("gpu" in machine) == torch.cuda.is_available()
    assert sweep["json"]["model"] == "demo"


def test_one_run_per_cache_size_with_speeds_and_hit_rates(sweep):
    """Each cache size gets its slots, prefill and decode speeds and hit rates; a cache holding every
    expert hits every time after the warmup, a 25 % cache misses."""
    total = sum(e.num_experts for e in PackedModel(DEMO_MODEL).manifest.expert_layers)
    runs = sweep["json"]["runs"]
    assert [r["cache_size"] for r in runs] == ["25%", "100%"]
    assert [r["slots"] for r in runs] == [round(0.25 * total), total]
    for r in runs:
        assert r["total_experts"] == total
        assert [p["tokens"] for p in r["prefill"]] == [16]
        for p in r["prefill"]:
            assert p["tok_s"] > 0 and p["s"] > 0 and 0 <= p["hit_rate"] <= 1
            assert len(p["runs_s"]) == 2 and min(p["runs_s"]) <= p["s"] <= max(p["runs_s"])  # the median of 2
        d = r["decode"]
        assert d["tokens"] == 4 and d["tok_s"] > 0 and d["s"] > 0
        assert 0 <= d["hit_rate"] <= 1
        assert r["experts"]["slots"] == r["slots"] and r["memory"]["expert_slots"] > 0
    quarter, full = runs[0]["decode"], runs[1]["decode"]
    assert full["hit_rate"] == 1.0 and full["misses"] == 0 and full["bytes_read_disk"] == 0
    assert runs[1]["prefill"][0]["hit_rate"] == 1.0 and runs[1]["experts"]["evictions"] == 0
    assert quarter["hit_rate"] < 1.0 and quarter["misses"] > 0 and quarter["bytes_read_disk"] > 0
    assert quarter["disk_gb_s_while_waiting"] is None or quarter["disk_gb_s_while_waiting"] > 0
    lines = [l for l in sweep["stdout"].splitlines() if l.startswith("cache")]
    assert len(lines) == 2 and f"({round(0.25 * total)}/{total} slots)" in lines[0] and f"({total}/{total} slots)" in lines[1]


def test_plot_is_a_png(sweep):
    """--plot writes a PNG of decode speed and hit rate per cache size."""
    assert sweep["png"].read_bytes()[:8] == PNG_SIGNATURE


def test_heatmap_has_a_row_per_cache_size(sweep):
    """--heatmap writes the hit rate per MoE layer, one row per cache size, from the JSON's cache stats."""
    from moestream.bench.heatmap import hit_rate_rows

    assert sweep["heatmap"].read_bytes()[:8] == PNG_SIGNATURE
    labels, layers, matrix = hit_rate_rows(sweep["json"])
    assert labels == ["cache 25%", "cache 100%"]
    for run, row in zip(sweep["json"]["runs"], matrix):
        assert row == [run["experts"]["hit_rate_per_layer"][str(layer)] for layer in layers]
    assert min(matrix[0]) < 1.0 and min(matrix[1]) > min(matrix[0])  # a 25 % cache misses, all resident barely


def test_compare_transformers(tmp_path):
    """--compare-transformers runs the same weights through transformers and reports the decode ratio."""
    out = tmp_path / "OUT.json"
    code, stdout, err = run_bench(["--model", str(DEMO_MODEL), "--device", "cpu", "--threads", "1", "--cache-sizes", "100%",
                                   "--prefill-tokens", "8", "--decode-tokens", "2", "--compare-transformers",
                                   "--out", str(out)])
    assert code == 0, err
    results = json.loads(out.read_text())
    ref = results["transformers"]
    assert ref["prefill_tokens"] == 8 and ref["decode_tokens"] == 2
    assert ref["prefill_tok_s"] > 0 and ref["decode_tok_s"] > 0
    assert ref["decode_ratio"] == round(results["runs"][-1]["decode"]["tok_s"] / ref["decode_tok_s"], 3)
    assert "moestream / transformers decode" in stdout


def test_compare_transformers_on_the_default_demo_model(tmp_path):
    """--compare-transformers without --model compares the built-in demo model."""
    out = tmp_path / "OUT.json"
    code, _, err = run_bench(["--device", "cpu", "--threads", "1", "--cache-sizes", "100%", "--prefill-tokens", "8",
                              "--decode-tokens", "2", "--compare-transformers", "--out", str(out)])
    assert code == 0, err
    assert json.loads(out.read_text())["transformers"]["decode_tok_s"] > 0


def test_bench_runs_a_synth_model_without_tokenizer(tmp_path, monkeypatch):
    """bench needs no tokenizer: it runs on a `moestream synth` model (its intended use)."""
    monkeypatch.setitem(synth_module.SHAPES, "tiny-qwen3",
                        dict(synth_module.SHAPES["qwen3-30b-a3b"], hidden_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=8,
                             num_experts_per_tok=2, moe_intermediate_size=64, vocab_size=512,
                             max_position_embeddings=256))
    model = synth_module.synth("tiny-qwen3", tmp_path / "m")
    out = tmp_path / "OUT.json"
    code, _, err = run_bench(["--model", str(model), "--device", "cpu", "--threads", "1", "--cache-sizes", "50%,100%",
                              "--prefill-tokens", "8", "--decode-tokens", "3", "--warmup", "--out", str(out)])
    assert code == 0, err
    results = json.loads(out.read_text())
    assert results["model"] == str(model)
    assert [(r["slots"], r["total_experts"]) for r in results["runs"]] == [(8, 16), (16, 16)]
    for r in results["runs"]:
        assert [p["tokens"] for p in r["prefill"]] == [8]
        assert r["decode"]["tokens"] == 3 and r["decode"]["tok_s"] > 0


@pytest.mark.parametrize("where", ["missing", "not-a-model"])
def test_bad_model_path_is_one_line_error(where, tmp_path):
    """A --model that is not a packed model gives one error line, no traceback, exit 1, no JSON."""
    model = tmp_path / "model"
    if where == "not-a-model":
        model.mkdir()
        (model / "config.json").write_text("{}")
    out = tmp_path / "OUT.json"
    code, stdout, err = run_bench(["--model", str(model), "--device", "cpu", "--out", str(out)])
    assert code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream bench: error:") and str(model) in lines[0], err
    assert "Traceback" not in err and stdout == ""
    assert not out.exists()


@pytest.mark.parametrize("argv,needle", [
    (["--prefill-tokens", "1x"], "'1x' is not a positive number"),
    (["--prefill-tokens", "0"], "'0' is not a positive number"),
    (["--cache-sizes", "100%,bogus"], "bogus"),
    (["--prefill-tokens", "", "--compare-transformers"], "needs at least one --prefill-tokens"),
])
def test_bad_arguments_are_named_before_anything_runs(argv, needle, tmp_path):
    out = tmp_path / "OUT.json"
    code, stdout, err = run_bench(["--device", "cpu", *argv, "--out", str(out)])
    assert code == 2 and needle in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1 and stdout == "" and not out.exists()


CODE = ("class Vector:\n    def add(self, other):\n        return Vector(self.x + other.x, self.y + other.y)\n"
        "    def sub(self, other):\n        return Vector(self.x - other.x, self.y - other.y)\n    def mul(self, other):\n")


@pytest.mark.parametrize("flags,drafter", [(["--speculative", "ngram"], "ngram"),
                                           (["--speculative", "ngram", "--draft-tokens", "3"], "ngram"),
                                           (["--hot-head"], "hot-head")])
def test_bench_measures_speculation_beside_plain(flags, drafter, tmp_path):
    out = tmp_path / "OUT.json"
    code, stdout, err = run_bench(["--device", "cpu", "--threads", "1", "--prefill-tokens", "", "--decode-tokens", "48",
                                   "--prompt", CODE, *flags, "--out", str(out)])
    assert code == 0, err
    spec = json.loads(out.read_text())["runs"][0]["speculative"]
    assert spec["drafter"] == drafter and spec["same_tokens"] is True
    assert spec["order"] == ["plain", "speculative", "speculative", "plain"]
    assert len(spec["plain_tok_s"]) == len(spec["speculative_tok_s"]) == 2 and spec["speedup"] > 0
    assert spec["drafted"] > 0 and 0 < spec["accepted"] <= spec["drafted"]  # the code repeats: guesses are kept
    assert spec["tokens_per_step"] > 1.0 and spec["accept_rate"] == round(spec["accepted"] / spec["drafted"], 4)
    if drafter == "ngram":  # the policy's decision per verification: chosen, drafted, accepted, ms
        steps = spec["receipt"]["steps"]
        assert spec["receipt"]["step_fields"] == ["chosen", "drafted", "accepted", "verify_ms"]
        assert len(steps) == spec["receipt"]["verify_steps"]
        assert all(d <= c and a <= d for c, d, a, _ in steps)
        assert sum(a for _, _, a, _ in steps) == spec["receipt"]["accepted"]
    assert "speculative" in stdout


def test_bench_refuses_hot_head_with_speculative(tmp_path):
    code, _, err = run_bench(["--hot-head", "--speculative", "ngram"])
    assert code == 2 and "--hot-head" in err


def test_bench_times_verification_steps_and_predicts_speculation(tmp_path):
    out = tmp_path / "OUT.json"
    code, stdout, err = run_bench(["--device", "cpu", "--threads", "1", "--prefill-tokens", "", "--decode-tokens", "4",
                                   "--step-tokens", "4,1,2", "--out", str(out)])
    assert code == 0, err
    cost = json.loads(out.read_text())["runs"][0]["step_cost"]
    assert list(cost["step_ms"]) == ["1", "2", "4"] and all(ms > 0 for ms in cost["step_ms"].values())
    assert all(len(v) == cost["repeats"] for v in cost["step_ms_all"].values())
    predicted = cost["predicted"]
    assert [p["acceptance"] for p in predicted] == [0.5, 0.6, 0.7, 0.8, 0.9]
    assert all(p["speedup"] >= 1.0 and p["best_draft"] in (0, 1, 3) for p in predicted)
    # a higher acceptance never predicts less
    assert all(a["speedup"] <= b["speedup"] for a, b in zip(predicted, predicted[1:]))
    assert "step ms by tokens" in stdout


@pytest.mark.parametrize("value", ["0", "17", "2,x"])
def test_bench_refuses_bad_step_tokens_in_one_line(value):
    code, _, err = run_bench(["--device", "cpu", "--step-tokens", value])
    assert code != 0 and "--step-tokens" in err and "Traceback" not in err


def test_each_cache_size_is_written_as_it_finishes(tmp_path, monkeypatch):
    """A bench cut short after its first cache size leaves that size's figures, marked partial; a
    finished one has no mark."""
    import moestream.engine.engine as engine_module

    real_load, loads = engine_module.load_engine, []

    def load_then_fail(*args, **kwargs):
        loads.append(1)
        if len(loads) == 2:
            raise KeyboardInterrupt  # what a time limit's signal leaves: no final write
        return real_load(*args, **kwargs)

    monkeypatch.setattr(engine_module, "load_engine", load_then_fail)  # bench imports it when it runs
    out = tmp_path / "OUT.json"
    argv = ["--device", "cpu", "--threads", "1", "--cache-sizes", "100%,50%", "--prefill-tokens", "8",
            "--decode-tokens", "2", "--out", str(out)]
    with pytest.raises(KeyboardInterrupt):
        run_bench(argv)
    partial = json.loads(out.read_text())
    assert partial["partial"] is True and [r["cache_size"] for r in partial["runs"]] == ["100%"]
    monkeypatch.setattr(engine_module, "load_engine", real_load)
    code, _, err = run_bench(argv)
    assert code == 0, err
    done = json.loads(out.read_text())
    assert "partial" not in done and [r["cache_size"] for r in done["runs"]] == ["100%", "50%"]
