"""`moestream serve --timeline FILE`: the engine's work while serving, as Chrome trace JSON written
when the server stops."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parents[2]


def test_serve_writes_a_timeline_of_its_requests_when_it_stops(tiny_packed_model, tmp_path):
    trace = tmp_path / "serve.json"
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "--model", str(tiny_packed_model("qwen3_moe")),
                             "--port", "0", "--device", "cpu", "--cache-size", "min", "--log-level", "warning",
                             "--timeline", str(trace)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.poll() else "")
        url = line.split("listening on ")[1].split("/v1")[0]
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
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
