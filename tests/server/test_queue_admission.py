"""Admission at the queue's edge: a request's place (running or waiting) is free the moment its
answer is complete, so clients that send their next request as soon as they have an answer, as
many as the running slots plus the queue hold, are never refused."""
from __future__ import annotations

import threading

import pytest

from fake_engine import FakeEngine
from moestream.engine.types import SamplingParams
from moestream.server.jobs import Choice, Failed, Finished, Job
from moestream.server.worker import QueueFull, Worker

pytestmark = pytest.mark.timeout(120)


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
    from moestream.bench.instant_engine import BytesTokenizer, InstantEngine

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
