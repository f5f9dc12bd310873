"""A job's choices (n > 1, several prompts) run side by side in the batch scheduler, each in a slot
of its own, and each gets the tokens it gets alone; the worker counts them as the slots the job is
owed; a cancel or a failure ends all of them at once. On the stand-in engine of
tests/server/instant_engine.py (every step answered at once)."""
from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("torch")
from instant_engine import BytesTokenizer, InstantEngine  # noqa: E402
from moestream.engine.types import SamplingParams  # noqa: E402
from moestream.server.generation import choice_seed  # noqa: E402
from moestream.server.jobs import Choice, Failed, Finished, Job, TextDelta  # noqa: E402
from job_events import event_collector  # noqa: E402
from moestream.server.worker import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(120)

VOCAB = 512
PROMPT = [5, 6, 7, 8, 9]


class Steps:
    """An observer of the decode steps' sizes."""

    def __init__(self) -> None:
        self.sizes: list[int] = []

    def batch_step(self, rows: int) -> None:
        self.sizes.append(rows)

    def __getattr__(self, name: str):  # the other figures are not looked at here
        return lambda *args: None


def started_worker(parallel: int, engine: InstantEngine | None = None) -> tuple[Worker, InstantEngine, Steps]:
    engine = engine or InstantEngine(parallel, BytesTokenizer(), vocab=VOCAB)
    worker = Worker(lambda: engine, parallel=parallel)
    steps = Steps()
    worker.observers.append(steps)
    worker.start()
    assert worker.wait_ready(30), worker.error
    return worker, engine, steps


def sampled(seed: int) -> SamplingParams:
    return SamplingParams(temperature=0.9, top_p=0.95, top_k=64, seed=seed)


def texts(events, n: int) -> list[str]:
    return ["".join(e.text for e in events if isinstance(e, TextDelta) and e.index == i) for i in range(n)]


def run_job(worker: Worker, choices: list[Choice]) -> list:
    events, done, sink = event_collector()
    worker.submit(Job(choices, sink=sink))
    assert done.wait(60)
    return events


def alone(choices: list[Choice]) -> list[str]:
    """Each choice as a request of its own, one after another."""
    worker, _, _ = started_worker(2)
    try:
        return [texts(run_job(worker, [c]), 1)[0] for c in choices]
    finally:
        worker.shutdown(10)


@pytest.mark.parametrize("parallel,n", [(4, 3), (2, 5)])
def test_n_choices_run_side_by_side_with_the_tokens_they_get_alone(parallel, n):
    choices = [Choice(PROMPT, 24 + 3 * i, sampled(choice_seed(11, i))) for i in range(n)]
    worker, engine, steps = started_worker(parallel)
    try:
        events = run_job(worker, choices)
    finally:
        worker.shutdown(10)
    ends = [e for e in events if isinstance(e, Finished)]
    assert sorted(e.index for e in ends) == list(range(n))
    assert [e.last for e in ends] == [False] * (n - 1) + [True]  # the last to end, whatever its index
    assert texts(events, n) == alone(choices)
    assert max(steps.sizes) == min(n, parallel)  # its choices shared decode steps
    assert engine.open_sequences == []


def test_a_later_choice_of_the_same_prompt_waits_for_the_first_ones_prefill():
    """So the KV pool has the prompt's blocks to share when it starts."""
    engine = InstantEngine(4, BytesTokenizer(), vocab=VOCAB)
    calls = []
    prefill, step_many = engine.prefill, engine.step_many
    engine.prefill = lambda ids, **kw: calls.append(("prefill", kw["seq"], len(engine.open_sequences))) or \
        prefill(ids, **kw)
    engine.step_many = lambda batch: calls.append(("step", sorted(batch))) or step_many(batch)
    worker, _, _ = started_worker(4, engine)
    try:
        run_job(worker, [Choice(PROMPT, 6, sampled(choice_seed(3, i))) for i in range(3)] +
                [Choice([1, 2, 3], 6, SamplingParams())])
    finally:
        worker.shutdown(10)
    # choice 0 prefills alone; the others (in order, the other prompt after them) start once it is in
    prefills = [c for c in calls if c[0] == "prefill"]
    assert prefills[0][2] == 1 and [c[2] for c in prefills[1:]] == [4, 4, 4]
    assert max(len(c[1]) for c in calls if c[0] == "step") == 4


def test_a_job_owes_a_slot_per_choice_so_others_wait_for_a_free_one():
    engine = InstantEngine(4, BytesTokenizer(), vocab=VOCAB, step_s=0.002)
    worker, _, steps = started_worker(4, engine)
    try:
        big, big_done, big_sink = event_collector()
        worker.submit(Job([Choice(PROMPT, 200, SamplingParams(seed=i)) for i in range(3)], sink=big_sink))
        small, small_done, small_sink = event_collector()
        worker.submit(Job([Choice([1, 2], 200, SamplingParams())], sink=small_sink))
        third, third_done, third_sink = event_collector()
        worker.submit(Job([Choice([3, 4], 5, SamplingParams())], sink=third_sink))
        deadline = time.monotonic() + 10
        while worker.running < 2 and time.monotonic() < deadline:
            time.sleep(0.001)
        with worker._cond:
            free = worker._free_slots_locked()
            waiting = len(worker._waiting)
        assert (free, waiting) == (0, 1)  # 3 + 1 slots owed: the third waits
        for done in (big_done, small_done, third_done):
            assert done.wait(60)
        assert max(steps.sizes) == 4
    finally:
        worker.shutdown(10)


def test_cancelling_a_job_ends_all_its_choices():
    engine = InstantEngine(4, BytesTokenizer(), vocab=VOCAB, step_s=0.002)
    worker, engine, _ = started_worker(4, engine)
    try:
        events: list = []
        seen = threading.Event()

        def sink(event):
            events.append(event)
            if isinstance(event, TextDelta) and len({e.index for e in events if isinstance(e, TextDelta)}) == 3:
                seen.set()

        job = Job([Choice(PROMPT, 3000, SamplingParams(seed=i)) for i in range(3)], sink=sink)
        worker.submit(job)
        assert seen.wait(30)
        job.cancel()
        assert job.done.wait(10)
        ends = [e for e in events if isinstance(e, (Finished, Failed))]
        assert len(ends) == 1 and ends[0].finish_reason == "cancelled" and ends[0].last
        assert engine.open_sequences == [] and worker.running == 0
    finally:
        worker.shutdown(10)
