"""`moestream serve --timeline FILE`: the engine's work while serving, as Chrome trace JSON written
when the server stops."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from serve_process import start_serve

pytestmark = pytest.mark.timeout(120)


def test_serve_writes_a_timeline_of_its_requests_when_it_stops(tiny_packed_model, tmp_path):
    trace = tmp_path / "serve.json"
    proc, url = start_serve("--model", str(tiny_packed_model("qwen3_moe")), "--device", "cpu", "--cache-size", "min",
                            "--log-level", "warning", "--timeline", str(trace))
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "def fib", "max_tokens": 5, "temperature": 0},
                       timeout=60)
        assert r.status_code == 200
        assert not trace.exists()  # written when the server stops
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    events = json.loads(trace.read_text())
    events = events["traceEvents"] if isinstance(events, dict) else events
    names = {e.get("name") for e in events}
    assert {"step", "load"} <= names, sorted(n for n in names if n)
