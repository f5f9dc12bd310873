"""Timelines: `moestream generate --timeline` writes valid trace-event JSON with the expected spans
(steps, expert loads, waits on reads, reads, copies, the decoder's segments), nested as they ran,
without changing a token; with no timeline every hook does nothing."""
from __future__ import annotations

import json
import threading

import pytest

from moestream.engine import timeline
from moestream.commands.generate import main as generate_main

# plain decoding (the demo model ships a draft that generate would use): one step span per token
PROMPT = ["--prompt-ids", "1,2,3,4,5,6,7,8,9,10,11,12", "--device", "cpu", "--threads", "1", "--draft", "off"]


def events_of(path) -> list[dict]:
    trace = json.loads(path.read_text())
    assert set(trace) >= {"traceEvents"}
    events = trace["traceEvents"]
    for e in events:  # what chrome://tracing and Perfetto need of every event
        assert e["ph"] in ("X", "i", "M"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["tid"], int) and e["ts"] >= 0
        if e["ph"] == "X":
            assert e["dur"] >= 0
    return events


def inside(inner: dict, outer: dict) -> bool:
    slack = 1.0  # µs: both ends are rounded to a thousandth
    return outer["ts"] - slack <= inner["ts"] and inner["ts"] + inner["dur"] <= outer["ts"] + outer["dur"] + slack


def run_json(argv, capsys) -> dict:
    assert generate_main(argv) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_generate_writes_a_trace_with_the_expected_spans(tmp_path, capsys):
    path = tmp_path / "run.json"
    max_new = 5
    plain = run_json([*PROMPT, "--max-new", str(max_new), "--json"], capsys)
    traced = run_json([*PROMPT, "--max-new", str(max_new), "--json", "--timeline", str(path)], capsys)
    assert traced["token_ids"] == plain["token_ids"]  # recording changes nothing
    assert not timeline.enabled()

    events = events_of(path)
    spans = [e for e in events if e["ph"] == "X"]
    names = {e["name"] for e in events}
    assert {"prefill_chunk", "step", "sample", "load", "wait_reads", "attention", "experts", "head", "read",
            "read_done"} <= names
    steps = [e for e in spans if e["name"] == "step"]
    assert len(steps) == max_new - 1  # the last token is sampled, never fed back
    assert len([e for e in spans if e["name"] == "sample"]) == max_new
    moe_layers = {e["args"]["layer"] for e in spans if e["name"] == "experts"}
    assert moe_layers
    # every decode step runs each MoE layer's attention, host half (load) and experts once
    loads = [e for e in spans if e["name"] == "load"]
    for step in steps:
        for kind in ("attention", "experts", "load"):
            layers = sorted(e["args"]["layer"] for e in spans if e["name"] == kind and inside(e, step))
            assert layers == sorted(moe_layers), (kind, step)
    # waits on reads happen inside a load of the same layer, on the same thread
    for wait in (e for e in spans if e["name"] == "wait_reads"):
        assert any(inside(wait, load) and load["args"]["layer"] == wait["args"]["layer"] and load["tid"] == wait["tid"]
                   for load in loads)
    # the demo's cache holds 30 % of the experts: reads really start, on the main thread, and finish
    # on the reader threads, which the trace names
    reads = [e for e in events if e["name"] == "read"]
    done = [e for e in events if e["name"] == "read_done"]
    assert reads and done
    assert sum(e["args"]["misses"] for e in loads) == traced["receipt"]["misses"]
    thread_names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert {thread_names[e["tid"]] for e in done} != {thread_names[steps[0]["tid"]]}


def test_host_tier_copies_are_in_the_trace(tmp_path, capsys):
    path = tmp_path / "host.json"
    run_json([*PROMPT, "--max-new", "12", "--json", "--host-cache-size", "100%", "--timeline", str(path)], capsys)
    copies = [e for e in events_of(path) if e["name"] == "copy"]
    assert copies, "a host tier holding every expert serves re-reads by copying into a slot"
    assert all({"layer", "expert", "early"} <= set(e["args"]) for e in copies)


def test_hooks_do_nothing_when_off():
    assert not timeline.enabled()
    with timeline.span("x", layer=1), timeline.segment(("attention-rows", 0, 1)):
        timeline.instant("y")
        timeline.complete("z", 0.0, 1.0)
    assert timeline.span("x") is timeline.span("y")  # one shared do-nothing context


def test_recorder_threads_nesting_and_names(tmp_path):
    path = tmp_path / "t.json"
    with timeline.recording(path) as rec:
        assert timeline.enabled()
        with timeline.span("outer", n=1):
            with timeline.segment(("experts", 3, 2)):
                pass
            worker = threading.Thread(target=lambda: timeline.instant("read", expert=7), name="reader-1")
            worker.start()
            worker.join()
        with pytest.raises(RuntimeError):
            with timeline.recording(tmp_path / "other.json"):
                pass
    assert rec is not None and not timeline.enabled()
    events = events_of(path)
    by_name = {e["name"]: e for e in events if e["ph"] != "M"}
    assert by_name["experts"]["args"] == {"layer": 3, "tokens": 2}
    assert by_name["experts"]["cat"] == "compute"
    assert inside(by_name["experts"], by_name["outer"])
    assert by_name["read"]["ph"] == "i" and by_name["read"]["tid"] != by_name["outer"]["tid"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names[by_name["read"]["tid"]] == "reader-1"
    assert not (tmp_path / "other.json").exists()


@pytest.mark.parametrize("key,expected", [
    (("attention-rows", 2, 1), ("attention", {"layer": 2, "tokens": 1})),
    (("experts", 2, 4), ("experts", {"layer": 2, "tokens": 4})),
    (("head", 2), ("head", {"tokens": 2})),
    (("head",), ("head", {})),
    (("start", 3), ("start", {"tokens": 3})),
    (("step", 1), ("step", {"tokens": 1})),
])
def test_segment_names(key, expected):
    assert timeline.segment_name(key) == expected


def test_bench_names_one_file_per_cache_size():
    from moestream.commands.bench import timeline_path

    assert timeline_path(None, "30%", 2) is None
    assert timeline_path("out/run.json", "30%", 1) == "out/run.json"
    assert timeline_path("out/run.json", "30%", 2) == "out/run-30%.json"
