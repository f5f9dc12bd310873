"""One generation at a time, a bounded FIFO queue, 503 with Retry-After beyond it, cancellation of
abandoned requests (queued, prefilling or decoding), and KV prefix reuse across requests."""
from __future__ import annotations

import threading
import time

import httpx
import pytest

from conftest import MODEL_ID, live_server
from fake_engine import FakeEngine, FakeTokenizer, reference_ids
from moestream.engine.types import SamplingParams

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run


def chat_body(content: str = "hi", max_tokens: int = 1000, **kw) -> dict:
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": max_tokens, **kw}


def wait_for(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.005)
    raise AssertionError("condition not reached in time")


def background_post(url: str, body: dict, results: dict, key: str, timeout: float = 30.0) -> threading.Thread:
    def run():
        try:
            results[key] = httpx.post(url, json=body, timeout=timeout)
        except Exception as exc:  # noqa: BLE001 - the test looks at what happened
            results[key] = exc
    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.fixture(scope="module")
def slow():
    engine = FakeEngine(token_delay=0.02)
    with live_server(engine, max_queue=2) as s:
        yield s


def test_queue_overflow_gets_503_with_retry_after(slow):
    url = slow.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client, client.stream("POST", url, json=chat_body(stream=True)) as running:
        lines = running.iter_lines()  # (dropping this iterator would close the connection)
        next(lines)
        wait_for(lambda: slow.worker.busy)
        results: dict = {}
        waiters = [background_post(url, chat_body(f"w{i}", max_tokens=2), results, f"w{i}") for i in range(2)]
        wait_for(lambda: slow.worker.queue_depth == 2)
        refused = httpx.post(url, json=chat_body("x", max_tokens=2), timeout=5)
        assert refused.status_code == 503
        assert 1 <= int(refused.headers["retry-after"]) <= 10
        error = refused.json()["error"]
        assert error["code"] == "server_busy" and set(error) == {"message", "type", "param", "code"}
        refused_stream = httpx.post(url, json=chat_body("x", max_tokens=2, stream=True), timeout=5)
        assert refused_stream.status_code == 503
    # closing the running stream cancels it; the queued ones then complete normally
    for t in waiters:
        t.join(10)
    assert all(r.status_code == 200 for r in results.values()), results
    slow.wait_idle()
    assert slow.engine.max_active == 1


def test_queue_is_first_in_first_out(slow):
    url = slow.url + "/v1/completions"
    order: list[str] = []
    lock = threading.Lock()

    def run(name: str) -> None:
        tokens = 40 if name == "first" else 3
        r = httpx.post(url, json={"model": MODEL_ID, "prompt": name, "max_tokens": tokens, "temperature": 0},
                       timeout=30)
        assert r.status_code == 200
        with lock:
            order.append(name)

    blocker = threading.Thread(target=run, args=("first",))
    blocker.start()
    wait_for(lambda: slow.worker.busy)
    threads = []
    for i, name in enumerate(["second", "third"]):
        t = threading.Thread(target=run, args=(name,))
        t.start()
        threads.append(t)
        wait_for(lambda: slow.worker.queue_depth == i + 1)
    for t in [blocker, *threads]:
        t.join(10)
    assert order == ["first", "second", "third"]


def test_stream_disconnect_stops_the_engine_within_a_second(slow):
    url = slow.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as client:
        with client.stream("POST", url, json=chat_body("long", stream=True)) as response:
            lines = response.iter_lines()
            for _ in range(6):
                next(lines)
            assert slow.engine.active
            closed_at = time.monotonic()
    slow.wait_idle(timeout=1.0)
    assert time.monotonic() - closed_at < 1.0
    assert slow.engine.max_active == 1


def test_non_streaming_disconnect_stops_the_engine(slow):
    url = slow.url + "/v1/chat/completions"
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(url, json=chat_body("long"), timeout=httpx.Timeout(30, read=0.3))
    gone_at = time.monotonic()
    slow.wait_idle(timeout=1.0)
    assert time.monotonic() - gone_at < 1.0


def test_disconnect_while_queued_leaves_the_queue(slow):
    url = slow.url + "/v1/chat/completions"
    with httpx.Client(timeout=30) as a, a.stream("POST", url, json=chat_body("running", stream=True)) as running:
        lines = running.iter_lines()
        next(lines)
        with httpx.Client(timeout=30) as b:
            with b.stream("POST", url, json=chat_body("queued", stream=True)) as queued:
                assert queued.status_code == 200  # headers go out at once; events wait for the engine
                wait_for(lambda: slow.worker.queue_depth == 1)
            wait_for(lambda: slow.worker.queue_depth == 0, timeout=1.0)
            with pytest.raises(httpx.ReadTimeout):
                b.post(url, json=chat_body("queued2"), timeout=httpx.Timeout(30, read=0.3))
            wait_for(lambda: slow.worker.queue_depth == 0, timeout=1.0)
        assert slow.engine.active  # the running one was not disturbed
        assert next(line for line in lines if line).startswith("data:")
    slow.wait_idle(timeout=1.0)


def test_disconnect_during_prefill():
    engine = FakeEngine(prefill_delay=0.01)  # 1,000 prompt tokens: 10 s of prefill
    with live_server(engine) as s:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + "/v1/completions", json={"prompt": "p" * 1000, "max_tokens": 5},
                       timeout=httpx.Timeout(30, read=0.3))
        gone_at = time.monotonic()
        s.wait_idle(timeout=1.0)
        assert time.monotonic() - gone_at < 1.0


def _common(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_prefix_reuse_prefills_only_new_tokens(server, client):
    tokenizer = FakeTokenizer()

    def conversation(i: int):
        first = [{"role": "system", "content": "you are a test"}, {"role": "user", "content": f"hello there {i}"}]
        first_ids = tokenizer.chat_ids(first)
        reply_ids = reference_ids(first_ids, 12, SamplingParams())
        second = first + [{"role": "assistant", "content": tokenizer.decode(reply_ids)},
                          {"role": "user", "content": "and more"}]
        kv = first_ids + reply_ids[:-1]  # what the engine holds after the first request
        return first, second, _common(kv, tokenizer.chat_ids(second)), len(first_ids)

    # a conversation whose reply re-tokenizes as generated, so the reply is reused too
    first_messages, second_messages, common, first_len = next(
        c for c in map(conversation, range(50)) if c[2] > c[3] + 3)
    client.chat.completions.create(model=MODEL_ID, messages=first_messages, temperature=0, max_tokens=12)
    second = client.chat.completions.create(model=MODEL_ID, messages=second_messages, temperature=0, max_tokens=5)
    t = second.model_extra["timings"]
    second_ids = tokenizer.chat_ids(second_messages)
    assert t["reused_tokens"] == common == second.usage.prompt_tokens_details.cached_tokens
    assert t["prefill_tokens"] == t["prompt_n"] == len(second_ids) - common
    assert second.usage.prompt_tokens == len(second_ids)
    # an unrelated prompt reuses (almost) nothing
    other = client.chat.completions.create(model=MODEL_ID, messages=[{"role": "user", "content": "zzz"}],
                                           temperature=0, max_tokens=2)
    assert other.model_extra["timings"]["prefill_tokens"] >= other.usage.prompt_tokens - 8


def test_generation_runs_on_one_thread_only(server):
    assert server.engine.owner_thread == server.worker._thread.ident
    assert server.engine.max_active == 1
