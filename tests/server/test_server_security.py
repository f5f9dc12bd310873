"""API key (constant-time, every /v1 and /api/v1 route, /health public), CORS, /health states and
failures after the stream has started."""
from __future__ import annotations

import hashlib
import time

import httpx
import openai
import pytest

from conftest import API_KEY, MODEL_ID, live_server
from fake_engine import FakeEngine
from moestream.errors import MoestreamError
from moestream.server import app as app_module
from moestream.server.queue_limits import default_queue_tokens

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

CHAT_BODY = {"model": MODEL_ID, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}


@pytest.fixture(scope="module")
def keyed():
    with live_server(FakeEngine(), api_key=API_KEY) as s:
        yield s


ROUTES = [("GET", "/v1/models"), ("GET", f"/v1/models/{MODEL_ID}"), ("POST", "/v1/chat/completions"),
          ("POST", "/v1/completions"), ("GET", "/api/v1/models"), ("POST", "/api/v1/chat/completions"),
          ("POST", "/api/v1/completions"), ("GET", "/v1/not-a-route"), ("GET", "/v1")]


@pytest.mark.parametrize("method,path", ROUTES)
@pytest.mark.parametrize("auth", [None, "Bearer wrong", "Bearer " + API_KEY + "x", "Basic " + API_KEY, API_KEY,
                                  "Bearer"])
def test_key_required_on_every_api_route(keyed, method, path, auth):
    headers = {"Authorization": auth} if auth is not None else {}
    r = httpx.request(method, keyed.url + path, headers=headers, json=CHAT_BODY if method == "POST" else None)
    assert r.status_code == 401
    error = r.json()["error"]
    assert error["code"] == "invalid_api_key" and set(error) == {"message", "type", "param", "code"}
    assert r.headers["www-authenticate"] == "Bearer"


def test_right_key_is_accepted(keyed):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    assert httpx.get(keyed.url + "/v1/models", headers=headers).status_code == 200
    assert httpx.get(keyed.url + "/api/v1/models", headers={"authorization": f"bearer {API_KEY}"}).status_code == 200
    with keyed.client() as client:
        r = client.chat.completions.create(model=MODEL_ID, messages=CHAT_BODY["messages"], max_tokens=3)
        assert r.usage.completion_tokens == 3
    with openai.OpenAI(base_url=keyed.base_url, api_key="nope", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()


def test_health_is_public(keyed):
    r = httpx.get(keyed.url + "/health")
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_key_comparison_is_constant_time(keyed, monkeypatch):
    calls = []
    real = app_module.hmac.compare_digest

    def spy(a, b):
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(app_module.hmac, "compare_digest", spy)
    httpx.get(keyed.url + "/v1/models", headers={"Authorization": "Bearer short"})
    httpx.get(keyed.url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
    assert len(calls) == 2
    for given, expected in calls:
        assert len(given) == len(expected) == 32  # sha256 digests, whatever the key's length
        assert expected == hashlib.sha256(API_KEY.encode()).digest()


def test_cors_simple_and_preflight(keyed):
    origin = {"Origin": "https://chat.example"}
    r = httpx.get(keyed.url + "/v1/models", headers={**origin, "Authorization": f"Bearer {API_KEY}"})
    assert r.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in r.headers
    # refusals carry the header too, so a browser app can read the error
    r = httpx.get(keyed.url + "/v1/models", headers=origin)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"
    # preflight: answered without a key
    r = httpx.options(keyed.url + "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})
    assert r.status_code == 200
    assert r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    assert "access-control-allow-credentials" not in r.headers


def test_health_while_loading_then_ready():
    with live_server(load=lambda: FakeEngine.load(load_delay=1.0), wait_ready=False) as s:
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "loading" and "retry-after" in r.headers
        busy = httpx.post(s.url + "/v1/chat/completions", json=CHAT_BODY)
        assert busy.status_code == 503 and busy.json()["error"]["code"] == "model_loading"
        assert s.worker.wait_ready(10)
        r = httpx.get(s.url + "/health")
        assert r.status_code == 200
        body = r.json()
        assert body["status"] == "ok" and body["stats"]["slots"] == 16 and body["queue"]["max"] is None
        assert body["queue"]["max_tokens"] == default_queue_tokens() and body["queue"]["tokens"] == 0


def test_health_when_loading_failed():
    def load():
        raise MoestreamError("no such model directory")

    with live_server(load=load, wait_ready=False) as s:
        s.worker.wait_ready(5)
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.json()["status"] == "failed"
        assert "no such model directory" in r.json()["error"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "unavailable"


@pytest.fixture
def failing():
    engine = FakeEngine()
    engine.fail_on_prompt = ord("!")
    with live_server(engine) as s:
        yield s


def test_failure_after_headers_sends_an_error_event_then_done(failing):
    body = {"model": MODEL_ID, "prompt": "boom!", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", failing.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        events = [line[len("data: "):] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    import json
    error = json.loads(events[-2])["error"]
    assert error["code"] == "engine_error" and "fail" in error["message"]
    with failing.client() as client:
        with pytest.raises(openai.APIError):
            list(client.chat.completions.create(model=MODEL_ID, stream=True,
                                                messages=[{"role": "user", "content": "boom!"}]))
        # whole responses get a 500 in the same shape; the server keeps serving
        with pytest.raises(openai.InternalServerError):
            client.completions.create(model=MODEL_ID, prompt="boom!", max_tokens=3)
        assert client.completions.create(model=MODEL_ID, prompt="fine", max_tokens=3).usage.completion_tokens == 3


def test_shutdown_fails_waiting_requests():
    engine = FakeEngine(token_delay=0.05)
    with live_server(engine, max_queue=4) as s:
        body = {"model": MODEL_ID, "prompt": "x", "max_tokens": 200, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            next(lines)
            with httpx.stream("POST", s.url + "/v1/completions", json=body) as waiting:
                deadline = time.monotonic() + 5
                while s.worker.queue_depth == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
                assert s.worker.shutdown(timeout=2)
                events = [line for line in waiting.iter_lines() if line.startswith("data: ")]
            assert "server_shutdown" in events[-2] and events[-1] == "data: [DONE]"
            rest = [line for line in lines if line.startswith("data: ")]
            assert rest[-1] == "data: [DONE]" and "server_shutdown" in rest[-2]
        assert not engine.active
