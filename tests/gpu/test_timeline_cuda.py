"""Timelines on CUDA: the device track holds each segment's run on the GPU (CUDA events), placed
inside the run on the host clock; streamed steps show the host's sync and loads, resident ones
one whole-step segment."""
import json

import pytest

from moestream.engine import timeline
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu
PROMPT = list(range(1, 17))


def trace_of(tmp_path, name, **opts) -> list[dict]:
    engine = Engine.load(None, options=EngineOptions(device="cuda", max_context=256, **opts))
    path = tmp_path / name
    try:
        list(engine.generate(PROMPT, max_new_tokens=4, stop_at_eos=False))  # graphs captured outside the trace
        with timeline.recording(path, device=engine.device):
            list(engine.generate(PROMPT, max_new_tokens=6, stop_at_eos=False))
    finally:
        engine.close()
    return json.loads(path.read_text())["traceEvents"]


def check_device_track(events: list[dict], names: set[str]) -> list[dict]:
    device = [e for e in events if e.get("cat") == "device"]
    assert {e["name"] for e in device} >= names
    assert {e["tid"] for e in device} == {timeline.DEVICE_TID}
    host = [e for e in events if e.get("cat") == "host" and e["ph"] == "X"]
    first, last = min(e["ts"] for e in host), max(e["ts"] + e["dur"] for e in host)
    for e in device:
        assert e["dur"] > 0
        # the device runs a segment after the host queued it and before the host's last span ended
        assert first - 1000 <= e["ts"] <= last + 1000, e
    thread_names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert thread_names[timeline.DEVICE_TID].startswith("device (cuda")
    return device


def test_streamed_steps_have_device_segments_and_host_syncs(tmp_path):
    events = trace_of(tmp_path, "streamed.json", cache_size="30%")
    device = check_device_track(events, {"experts", "head"})
    # a layer's attention: a step's rows at once
    assert "attention" in {e["name"] for e in device}
    names = {e["name"] for e in events}
    assert {"sync", "load", "step"} <= names


def test_resident_steps_have_no_host_loads(tmp_path):
    events = trace_of(tmp_path, "resident.json", cache_size="100%")
    device = check_device_track(events, set())
    assert {e["name"] for e in device} <= {"start", "attention", "experts", "head", "step"}
    # 5 decode steps: one whole-step graph each when every layer is capturable (and the prompt's one,
    # --prefill-graphs), else 5 heads
    whole = [e for e in device if e["name"] == "step"]
    assert len(whole) == 1 + 5 or len([e for e in device if e["name"] == "head"]) == 5
    assert not [e for e in events if e["name"] in ("sync", "read")]
