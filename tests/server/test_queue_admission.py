"""Admission at the queue's edge: a request's place (running or waiting) is free the moment its
answer is complete, so clients that send their next request as soon as they have an answer, as
many as the running slots plus the queue hold, are never refused; the queue is bounded by the
prompt tokens its requests hold (a count only where one is set)."""
from __future__ import annotations

import threading

import time

import httpx
import pytest

from conftest import live_server
from fake_engine import FakeEngine
from moestream.engine.types import SamplingParams
from moestream.server.jobs import Choice, Failed, Finished, Job
from moestream.server.queue_limits import QueueLimits, default_queue_tokens
from moestream.server.worker import QueueFull, Worker

pytestmark = pytest.mark.timeout(120)


def wait_until(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


class EagerClient:
    """Sends `rounds` requests one after another, each from inside the sink that receives the previous
    one's last event: the earliest instant a client can know its answer is complete."""

    def __init__(self, worker: Worker, name: int, rounds: int) -> None:
        self.worker, self.name, self.rounds = worker, name, rounds
        self.answered = 0
        self.refused: list[str] = []
        self.finished = threading.Event()

    def send(self) -> None:
        prompt = [1 + self.name, 2, 3 + self.answered % 5]
        job = Job([Choice(prompt, 3 + self.answered % 4, SamplingParams())], sink=self.on_event)
        try:
            self.worker.submit(job)
        except QueueFull as exc:
            self.refused.append(str(exc))
            self.finished.set()

    def on_event(self, event) -> None:
        if isinstance(event, Failed):
            self.refused.append(event.message)
            self.finished.set()
        elif isinstance(event, Finished) and event.last:
            self.answered += 1
            if self.answered == self.rounds:
                self.finished.set()
            else:
                self.send()


def run_clients(worker: Worker, clients: int, rounds: int) -> list[EagerClient]:
    worker.start()
    assert worker.wait_ready(30), worker.error
    try:
        group = [EagerClient(worker, i, rounds) for i in range(clients)]
        for c in group:  # exactly the capacity at once: every slot busy and the queue full
            c.send()
        for c in group:
            assert c.finished.wait(60), "a client never got its answers"
        return group
    finally:
        worker.shutdown(10)


def assert_none_refused(group: list[EagerClient], rounds: int) -> None:
    refused = [(c.name, c.answered, c.refused) for c in group if c.refused]
    assert not refused, f"refused although the running and waiting requests fit: {refused}"
    assert all(c.answered == rounds for c in group)


@pytest.mark.parametrize("max_queue", [1, 3])
def test_one_at_a_time_frees_its_place_with_the_answer(max_queue):
    worker = Worker(lambda: FakeEngine(token_delay=0.001), max_queue=max_queue, parallel=1)
    assert_none_refused(run_clients(worker, 1 + max_queue, rounds=12), 12)


@pytest.mark.parametrize("parallel,max_queue", [(2, 2), (4, 4)])
def test_batched_frees_its_place_with_the_answer(parallel, max_queue):
    pytest.importorskip("torch")
    from instant_engine import BytesTokenizer, InstantEngine

    engine = InstantEngine(parallel, BytesTokenizer(), vocab=512)
    worker = Worker(lambda: engine, max_queue=max_queue, parallel=parallel)
    assert_none_refused(run_clients(worker, parallel + max_queue, rounds=12), 12)


def test_one_more_than_the_capacity_is_refused():
    """The other side of the edge: with every slot busy and the queue full, one more is a QueueFull."""
    gate = threading.Event()
    engine = FakeEngine()
    worker = Worker(lambda: engine, max_queue=2, parallel=1).start()
    assert worker.wait_ready(30), worker.error
    try:
        original = engine.generate

        def held(*args, **kw):
            gate.wait(30)
            return original(*args, **kw)

        engine.generate = held
        for _ in range(3):
            worker.submit(Job([Choice([1, 2], 2, SamplingParams())], sink=lambda e: None))
        with pytest.raises(QueueFull):
            worker.submit(Job([Choice([1, 2], 2, SamplingParams())], sink=lambda e: None))
    finally:
        gate.set()
        worker.shutdown(10)


# ------------------------------------------------------------------ the queue bounded by prompt tokens

def test_limits_count_only_what_waits_beyond_the_free_slots():
    limits = QueueLimits(max_tokens=100)
    assert limits.refusal(waiting=1, held=0, free=2, tokens=10_000) is None  # a free slot takes it
    assert limits.refusal(waiting=2, held=0, free=2, tokens=10_000) is None  # the first to wait: any size
    assert limits.refusal(waiting=3, held=60, free=2, tokens=40) is None
    reason = limits.refusal(waiting=3, held=60, free=2, tokens=41)
    assert reason == "the waiting requests hold 60 prompt tokens and this one's 41 would pass the queue's limit of 100"
    counted = QueueLimits(max_tokens=100, max_requests=2)
    assert counted.refusal(waiting=2, held=1, free=1, tokens=1) is None
    assert counted.refusal(waiting=3, held=2, free=1, tokens=1) == "2 requests are already waiting"
    assert QueueLimits(max_tokens=1 << 40).max_requests is None  # no count limit unless asked
    with pytest.raises(ValueError):
        QueueLimits(max_tokens=0)


def test_the_default_budget_follows_the_machines_memory():
    gib = 1 << 30
    assert default_queue_tokens(16 * gib) == 16 * gib // 64 // 64 == 4 * 1024 * 1024
    assert default_queue_tokens(128 * gib) == 8 * default_queue_tokens(16 * gib)
    assert default_queue_tokens(1 << 20) == 1 << 16  # a floor on a tiny machine
    assert default_queue_tokens() >= 1 << 16  # this machine's


def held_worker(**kw):
    """A started one-slot Worker whose engine waits for `gate` before each generation."""
    gate = threading.Event()
    engine = FakeEngine()
    original = engine.generate

    def held(*args, **kwargs):
        gate.wait(30)
        return original(*args, **kwargs)

    engine.generate = held
    worker = Worker(lambda: engine, parallel=1, **kw).start()
    assert worker.wait_ready(30), worker.error
    return worker, gate


def job(tokens: int, n: int = 1) -> Job:
    return Job([Choice(list(range(1, tokens + 1)), 2, SamplingParams()) for _ in range(n)], sink=lambda e: None)


def test_waiting_requests_are_bounded_by_their_prompt_tokens_not_a_count():
    worker, gate = held_worker(queue_tokens=100)
    try:
        worker.submit(job(500))  # runs (or is about to): never counted
        wait_until(lambda: worker.running == 1)
        worker.submit(job(150))  # the first to wait, larger than the budget: nothing else waits
        with pytest.raises(QueueFull, match="hold 150 prompt tokens and this one's 1 would pass"):
            worker.submit(job(1))
        left = worker.queue_tokens
        worker._waiting[0].cancel()  # its client left: its tokens leave with it
        assert (worker.queue_depth, worker.queue_tokens, left) == (0, 0, 150)
        for _ in range(20):
            worker.submit(job(5))  # 20 requests, no count limit: 100 tokens
        with pytest.raises(QueueFull):
            worker.submit(job(1))
        assert (worker.queue_depth, worker.queue_tokens) == (20, 100)
    finally:
        gate.set()
        worker.shutdown(10)
    assert worker.queue_tokens == 0


def test_n_choices_hold_a_prompt_each():
    worker, gate = held_worker(queue_tokens=100)
    try:
        worker.submit(job(10))
        wait_until(lambda: worker.running == 1)
        worker.submit(job(20, n=3))
        assert worker.queue_tokens == 60
        with pytest.raises(QueueFull):
            worker.submit(job(20, n=3))
        worker.submit(job(20, n=2))
    finally:
        gate.set()
        worker.shutdown(10)


def test_the_count_limit_still_applies_when_set():
    worker, gate = held_worker(max_queue=2, queue_tokens=1 << 20)
    try:
        worker.submit(job(3))
        wait_until(lambda: worker.running == 1)
        worker.submit(job(3))
        worker.submit(job(3))
        with pytest.raises(QueueFull, match="2 requests are already waiting"):
            worker.submit(job(3))
    finally:
        gate.set()
        worker.shutdown(10)


def test_a_request_beyond_the_budget_gets_503_over_http():
    engine = FakeEngine(token_delay=0.05)
    with live_server(engine, queue_tokens=64) as s, s.http() as http:
        with http.stream("POST", "/v1/completions", json={"prompt": "running", "max_tokens": 400,
                                                          "stream": True}) as running:
            lines = running.iter_lines()  # (dropping this iterator would close the connection)
            next(lines)
            wait_until(lambda: s.worker.running == 1)
            results: dict = {}
            first = threading.Thread(target=lambda: results.setdefault(
                "first", httpx.post(s.url + "/v1/completions", json={"prompt": "w" * 60, "max_tokens": 1},
                                    timeout=60)))
            first.start()
            wait_until(lambda: s.worker.queue_depth == 1)
            refused = http.post("/v1/completions", json={"prompt": "x" * 10, "max_tokens": 1})
            assert refused.status_code == 503, (refused.text, http.get("/health").json())
            assert 1 <= int(refused.headers["retry-after"]) <= 10
            error = refused.json()["error"]
            assert error["code"] == "server_busy"
            assert error["message"] == ("The server is busy: the waiting requests hold 61 prompt tokens and this "
                                        "one's 11 would pass the queue's limit of 64. Retry later.")
            health = http.get("/health").json()["queue"]
            assert (health["waiting"], health["tokens"], health["max_tokens"], health["max"]) == (1, 61, 64, None)
            metrics = http.get("/metrics").text
            assert "moestream_queue_tokens 61.0" in metrics and "moestream_queue_tokens_capacity 64.0" in metrics
            assert "moestream_queue_capacity +Inf" in metrics
        first.join(30)
        assert results["first"].status_code == 200
