"""Stopping the server closes the engine: when the ASGI lifespan ends, the worker cancels what
runs, stops, and closes the engine on its own thread, so the engine's reader threads end too."""
from __future__ import annotations

import threading
import time

import pytest
from fake_engine import FakeEngine
from starlette.testclient import TestClient

from moestream.engine.types import SamplingParams
from moestream.server.app import create_app
from moestream.server.jobs import Choice, Failed, Job, Started
from moestream.server.worker import Worker

pytestmark = pytest.mark.timeout(120)


def new_threads(before: set[threading.Thread]) -> list[str]:
    return [t.name for t in threading.enumerate() if t not in before and t.is_alive()]


def test_lifespan_end_cancels_the_running_job_then_closes_the_engine_on_its_thread():
    engine = FakeEngine(token_delay=0.05)
    worker = Worker(lambda: engine).start()
    events: list = []
    with TestClient(create_app(worker)) as http:
        assert worker.wait_ready(10)
        assert http.get("/health").json()["status"] == "ok"
        job = worker.submit(Job([Choice([1, 2, 3], 2000, SamplingParams())], events.append))
        deadline = time.monotonic() + 10
        while not any(isinstance(e, Started) for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert engine.closed_by is None  # open while the server runs
    assert job.done.is_set() and not worker._thread.is_alive() and worker.state == "stopped"
    assert isinstance(events[-1], Failed) and events[-1].code == "server_shutdown"
    assert engine.closed_by == engine.owner_thread == worker._thread.ident
    assert not engine.closed_while_active


def test_an_engine_that_fails_to_close_does_not_stop_the_shutdown(caplog):
    engine = FakeEngine()

    def refuse() -> None:
        raise OSError("disk gone")
    engine.on_close = refuse
    worker = Worker(lambda: engine).start()
    with TestClient(create_app(worker)):
        assert worker.wait_ready(10)
    assert not worker._thread.is_alive() and engine.closed_by is not None
    assert "closing the engine failed: disk gone" in caplog.text


def test_real_engine_reader_threads_end_with_the_server(tiny_packed_model):
    Engine = pytest.importorskip("moestream.engine.engine").Engine
    from moestream.engine.options import EngineOptions

    model = tiny_packed_model("qwen3_moe", "q4")
    before = set(threading.enumerate())
    # a small cache with a host tier: decoding reads records on the direct source's reader threads
    options = EngineOptions(device="cpu", cache_size="min", host_cache_size="1MiB", expert_source="direct")
    worker = Worker(lambda: Engine.load(model, options=options)).start()
    with TestClient(create_app(worker)) as http:
        assert worker.wait_ready(60), worker.error
        r = http.post("/v1/completions", json={"prompt": "def fib", "max_tokens": 6, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        readers = [t for t in new_threads(before) if "-io" in t]
        assert readers, new_threads(before)  # the engine really read on its own threads
    deadline = time.monotonic() + 5
    while new_threads(before) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert new_threads(before) == []
