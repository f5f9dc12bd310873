"""`moestream ab`: two fake commands (python -c printing seeded numbers) with a known ratio and
known noise; the order of runs, both ways of reading a number, the statistics, the files."""
from __future__ import annotations

import json
import shlex
import sys

import numpy as np
import pytest

from moestream.bench.ab import Run, analyse, metric_at, run_rounds
from moestream.commands.ab import main

PY = shlex.quote(sys.executable)


def noisy(mean: float, noise: float, seed_offset: int) -> str:
    """A command printing mean·(1 + noise·N(0,1)), seeded by its run index: reproducible runs."""
    code = f"import random; r = random.Random({seed_offset} + {{run}}); print({mean} * (1 + {noise} * r.gauss(0, 1)))"
    return f"{PY} -c {shlex.quote(code)}"


def test_order_is_a_b_b_a_per_round(tmp_path):
    log = tmp_path / "order.txt"
    runs = run_rounds(f"echo A >> {log}; echo 1", f"echo B >> {log}; echo 2", rounds=3)
    assert log.read_text().split() == list("ABBA" * 3)
    assert [r.label for r in runs] == list("ABBA" * 3)
    assert [r.round for r in runs] == [0] * 4 + [1] * 4 + [2] * 4
    assert [r.value for r in runs] == [1, 2, 2, 1] * 3


def test_a_known_ratio_above_the_noise():
    runs = run_rounds(noisy(100.0, 0.01, 0), noisy(120.0, 0.01, 1000), rounds=5)
    result = analyse(runs, seed=1)
    assert result["ratio"] == pytest.approx(1.2, abs=0.02)
    low, high = result["ci95"]
    assert low < result["ratio"] < high
    assert 1.17 < low and high < 1.23
    # A-A pairs of 1 % noise: |A2/A1 - 1| is a few percent at most, far below the 20 % difference
    assert 0 < result["noise_floor"] < 0.05
    assert result["above_noise"] is True
    assert len(result["aa_ratios"]) == 5


def test_the_same_command_twice_is_within_the_noise():
    runs = run_rounds(noisy(100.0, 0.05, 0), noisy(100.0, 0.05, 1000), rounds=6)
    result = analyse(runs, seed=0)
    low, high = result["ci95"]
    assert low < 1.0 < high
    assert result["above_noise"] is False
    assert abs(result["ratio"] - 1) < 0.05


def test_analysis_by_hand():
    # two rounds, exact numbers: ratio of means, A-A ratios and their 95th percentile of |r - 1|
    values = {(0, "A"): [10.0, 12.0], (0, "B"): [20.0, 22.0], (1, "A"): [11.0, 11.0], (1, "B"): [22.0, 24.0]}
    runs = []
    for r in (0, 1):
        seen = {"A": 0, "B": 0}
        for label in "ABBA":
            runs.append(Run(label, r, len(runs), values[(r, label)][seen[label]], 0.0))
            seen[label] += 1
    result = analyse(runs, seed=0, resamples=2000)
    assert result["ratio"] == pytest.approx((20 + 22 + 22 + 24) / (10 + 12 + 11 + 11), rel=1e-6)
    assert result["aa_ratios"] == [pytest.approx(1.2), pytest.approx(1.0)]
    assert result["noise_floor"] == pytest.approx(np.quantile([0.2, 0.0], 0.95), rel=1e-6)
    # every resample is round 0 alone (2.0...), round 1 alone (2.09...) or both
    assert result["ci95"][0] == pytest.approx(42 / 22, rel=1e-6)
    assert result["ci95"][1] == pytest.approx(46 / 22, rel=1e-6)
    assert result["above_noise"] is True  # 2x against a 19 % floor


def test_metric_path_into_the_json_each_run_writes(tmp_path, capsys):
    def writer(tok_s: float) -> str:
        code = f"import json, sys; json.dump({{'runs': [{{'decode': {{'tok_s': {tok_s}}}}}]}}, open(sys.argv[1], 'w'))"
        return f"{PY} -c {shlex.quote(code)} {{out}}"

    out, png = tmp_path / "ab.json", tmp_path / "ab.png"
    rc = main([writer(4.0), writer(6.0), "--rounds", "2", "--metric", "runs.-1.decode.tok_s", "--out", str(out),
               "--plot", str(png)])
    assert rc == 0
    assert capsys.readouterr().out.startswith("B/A = 1.5000 (95 % CI 1.5000 to 1.5000)")
    report = json.loads(out.read_text())
    assert report["result"]["ratio"] == 1.5
    assert report["result"]["noise_floor"] == 0.0
    assert report["result"]["above_noise"] is True
    assert [r["value"] for r in report["runs"]] == [4.0, 6.0, 6.0, 4.0] * 2
    assert report["metric"] == "runs.-1.decode.tok_s" and report["order"] == "ABBA"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_metric_at():
    data = {"decode": {"tok_s": 3}, "runs": [{"x": 1}, {"x": 2}]}
    assert metric_at(data, "decode.tok_s") == 3
    assert metric_at(data, "runs.0.x") == 1 and metric_at(data, "runs.-1.x") == 2
    for bad in ("decode.toks", "runs.2.x", "runs.x", "decode.tok_s.more"):
        with pytest.raises(KeyError):
            metric_at(data, bad)


@pytest.mark.parametrize("a,b,extra,message", [
    ("echo 1", "exit 3", [], "moestream ab: error: command B exited with 3: (no output on stderr)"),
    ("echo 1", "echo fast", [], "moestream ab: error: the last line of command B is \"fast\", not a finite number"),
    ("echo 0", "echo 1", [], "moestream ab: error: the last line of command A is 0: ratios need positive numbers"),
    ("true", "echo 1", [], "moestream ab: error: command A printed no number on its last line (true)"),
    ("echo 1 > {out}", "echo '{\"a\": 2}' > {out}", ["--metric", "a"],
     "moestream ab: error: command A's JSON has no 'a' (no 'a')"),
    ("true {out}", "true {out}", ["--metric", "a"], "moestream ab: error: command A wrote nothing to {out} (true {out})"),
])
def test_bad_runs_are_one_line(a, b, extra, message, capsys):
    rc = main([a, b, "--rounds", "2", *extra])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.splitlines() == [message]


def test_metric_needs_out_in_both_commands(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["echo 1 > {out}", "echo 1", "--metric", "x"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        "moestream ab: error: argument --metric: CMD_B must write its JSON to {out}"]
