"""The per-layer hit-rate heatmap of a receipt or bench JSON, and the summary of a --timeline trace
(time per kind of work, compute idle time by cause): on hand-made inputs with known answers and on
a real run of the demo model."""
import json
import math

import pytest

from moestream.bench.heatmap import ReportError, hit_rate_rows
from moestream.commands.heatmap import main as heatmap_main
from moestream.bench.timeline_summary import UNTRACED, TraceError, render, summarize
from moestream.commands.timeline import main as summary_main
from moestream.commands.generate import main as generate_main

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def span(name, ts, dur, tid=1, cat="host"):
    return {"name": name, "ph": "X", "ts": ts, "dur": dur, "pid": 7, "tid": tid, "cat": cat, "args": {}}


def test_summary_of_a_known_trace():
    """Device busy 0-10 and 40-90 ms; the host meanwhile loads (10-20) and waits on reads (20-40)."""
    ms = 1000.0
    trace = {"traceEvents": [
        {"name": "thread_name", "ph": "M", "pid": 7, "tid": 1, "args": {"name": "MainThread"}},
        {"name": "thread_name", "ph": "M", "pid": 7, "tid": 2, "args": {"name": "expert-io_0"}},
        span("step", 0, 100 * ms), span("load", 10 * ms, 30 * ms), span("wait_reads", 20 * ms, 20 * ms),
        span("sample", 90 * ms, 10 * ms), span("pread", 12 * ms, 25 * ms, tid=2),
        span("attention", 0, 10 * ms, tid=0, cat="device"), span("experts", 40 * ms, 50 * ms, tid=0, cat="device"),
        {"name": "read", "ph": "i", "s": "t", "ts": 11 * ms, "pid": 7, "tid": 1, "args": {}}]}
    s = summarize(trace)
    assert s["compute"] == {"track": "device", "busy_ms": 60.0, "window_ms": 90.0, "idle_ms": 30.0}
    assert s["idle_ms"] == {"wait_reads": 20.0, "load": 10.0}
    work = {(r["track"], r["name"]): (r["count"], r["total_ms"], r["self_ms"]) for r in s["work"]}
    assert work[("main", "step")] == (1, 100.0, 60.0)  # less load (30) and sample (10) nested in it
    assert work[("main", "load")] == (1, 30.0, 10.0)
    assert work[("expert-io_0", "pread")] == (1, 25.0, 25.0)
    assert work[("device", "experts")] == (1, 50.0, 50.0)
    assert "idle in wait_reads" in render(s)


def test_a_gap_with_no_host_span_is_untraced():
    trace = [span("step", 0, 10), span("experts", 0, 10, tid=0, cat="device"),
             span("experts", 30, 10, tid=0, cat="device"), span("step", 35, 5)]
    assert summarize(trace)["idle_ms"] == {UNTRACED: 0.02}


def test_not_a_trace():
    with pytest.raises(TraceError, match="no traceEvents"):
        summarize({"runs": []})
    with pytest.raises(TraceError, match="no step"):
        summarize([span("something", 0, 5)])


def test_heatmap_rows_of_a_receipt_and_a_bench_json():
    receipt = {"model": "m", "experts": {"hit_rate_per_layer": {"0": 0.5, "2": 0.25}}}
    assert hit_rate_rows(receipt) == (["receipt (m)"], [0, 2], [[0.5, 0.25]])
    bench = {"runs": [{"cache_size": "10%", "experts": {"hit_rate_per_layer": {"0": 0.1, "2": 0.2}}},
                      {"cache_size": "50%", "experts": {"hit_rate_per_layer": {"2": 0.9}}}]}
    labels, layers, matrix = hit_rate_rows(bench)
    assert labels == ["cache 10%", "cache 50%"] and layers == [0, 2]
    assert matrix[0] == [0.1, 0.2] and math.isnan(matrix[1][0]) and matrix[1][1] == 0.9
    with pytest.raises(ReportError, match="not a receipt or a bench JSON"):
        hit_rate_rows({"tokens": 3})
    with pytest.raises(ReportError, match="no hit_rate_per_layer"):
        hit_rate_rows({"experts": {"hits": 3}})


def test_heatmap_cli_refuses_bad_reports_in_one_line(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{not json")
    assert heatmap_main([str(tmp_path / "bad.json"), str(tmp_path / "h.png")]) == 1
    assert capsys.readouterr().err.splitlines() == [f"moestream heatmap: error: {tmp_path / 'bad.json'}: not JSON "
                                                    "(give a receipt or a bench JSON)"]
    (tmp_path / "r.json").write_text(json.dumps({"experts": {}}))
    assert heatmap_main([str(tmp_path / "r.json"), str(tmp_path / "h.png")]) == 1
    assert "no hit_rate_per_layer" in capsys.readouterr().err
    assert not (tmp_path / "h.png").exists()


def test_a_real_run(tmp_path, capsys):
    """The demo model at a 30 % cache: the receipt's heatmap and the trace's summary."""
    trace, receipt = tmp_path / "t.json", tmp_path / "r.json"
    argv = ["--prompt-ids", "1,2,3,4,5,6,7,8", "--max-new", "6", "--device", "cpu", "--threads", "1",
            "--timeline", str(trace), "--receipt", str(receipt)]
    assert generate_main(argv) == 0
    capsys.readouterr()
    assert heatmap_main([str(receipt), str(tmp_path / "h.png")]) == 0
    assert (tmp_path / "h.png").read_bytes()[:8] == PNG_SIGNATURE
    per_layer = json.loads(receipt.read_text())["experts"]["hit_rate_per_layer"]
    labels, layers, matrix = hit_rate_rows(json.loads(receipt.read_text()))
    assert [str(l) for l in layers] == sorted(per_layer, key=int) and matrix[0] == [per_layer[str(l)] for l in layers]

    s = summarize(json.loads(trace.read_text()))
    c = s["compute"]
    assert c["track"] == "cpu (decoder segments)" and 0 < c["busy_ms"] <= c["window_ms"]
    assert sum(s["idle_ms"].values()) == pytest.approx(c["idle_ms"], abs=0.01)
    tracks = {(r["track"], r["name"]) for r in s["work"]}
    assert {("main", "step"), ("main", "load"), ("main", "experts"), ("main", "attention")} <= tracks
    for r in s["work"]:
        assert 0 <= r["self_ms"] <= r["total_ms"] + 1e-6
    assert summary_main([str(trace)]) == 0
    assert "compute (cpu (decoder segments)): busy" in capsys.readouterr().out
