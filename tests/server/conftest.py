"""Fixtures: a really started server (uvicorn on a free loopback port, in a thread) around the
fake engine, and clients for it."""
from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from fake_engine import FakeEngine  # noqa: E402

from moestream.server.app import RequestDefaults, create_app  # noqa: E402
from moestream.server.main import bind_socket  # noqa: E402
from moestream.server.worker import Worker  # noqa: E402

MODEL_ID = "fake-moe"
API_KEY = "sk-test-key-123"


@dataclass
class LiveServer:
    url: str
    worker: Worker
    engine: FakeEngine | None
    api_key: str | None

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def client(self, **kw: Any):
        import openai
        return openai.OpenAI(base_url=self.base_url, api_key=self.api_key or "unused", max_retries=0,
                             timeout=kw.pop("timeout", 30.0), **kw)

    def http(self, **kw: Any) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        headers.update(kw.pop("headers", {}))
        return httpx.Client(base_url=self.url, headers=headers, timeout=kw.pop("timeout", 30.0), **kw)

    def wait_idle(self, timeout: float = 5.0) -> float:
        """Seconds until the engine is idle and the queue empty (raises if it never is)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if (self.engine is None or not self.engine.active) and not self.worker.busy and self.worker.queue_depth == 0:
                return time.monotonic() - start
            time.sleep(0.01)
        raise AssertionError("the engine is still busy")


@contextlib.contextmanager
def live_server(engine: FakeEngine | None = None, *, load: Callable[[], Any] | None = None,
                api_key: str | None = None, max_queue: int | None = None, queue_tokens: int | None = None,
                parallel: int = 1, max_body_bytes: int = 1 << 20,
                max_context: int | None = None, defaults: RequestDefaults | None = None,
                model_id: str | None = MODEL_ID, wait_ready: bool = True,
                speculation: Callable[[Any], Any] | None = None,
                reasoning_format: str = "auto") -> Iterator[LiveServer]:
    import uvicorn

    if load is None:
        engine = engine or FakeEngine()
        load = lambda: engine  # noqa: E731
    worker = Worker(load, max_queue=max_queue, queue_tokens=queue_tokens, parallel=parallel,
                    speculation=speculation).start()
    app = create_app(worker, api_key=api_key, model_id=model_id, max_body_bytes=max_body_bytes,
                     defaults=defaults or RequestDefaults(), max_context=max_context,
                     reasoning_format=reasoning_format)
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", log_config=None,
                                           timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started, "uvicorn did not start"
    if wait_ready:
        assert worker.wait_ready(30), worker.error
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", worker, engine, api_key)
    finally:
        server.should_exit = True
        worker.shutdown(timeout=5)
        thread.join(10)
        sock.close()


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    """A fast fake engine, no key; shared by a module's tests."""
    with live_server(FakeEngine(max_context=4096)) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: LiveServer):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def http(server: LiveServer) -> Iterator[httpx.Client]:
    with server.http() as c:
        yield c


TINY_MODEL_ID = "tiny-moe"


@pytest.fixture(scope="module")
def real(tiny_packed_model):
    """A live server over the tiny real qwen3_moe model on the CPU (2048 positions: room for a tools
    prompt), model id "tiny-moe"; a module with its own model overrides this fixture."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    model_dir = tiny_packed_model("qwen3_moe", max_position_embeddings=2048)
    with live_server(load=lambda: Engine.load(model_dir, options=EngineOptions(device="cpu")),
                     model_id=TINY_MODEL_ID) as s:
        yield s


@pytest.fixture(scope="module")
def sdk(real):
    """An openai client of `real`."""
    with real.client() as c:
        yield c
