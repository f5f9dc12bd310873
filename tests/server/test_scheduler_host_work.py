"""The batch scheduler's host work per step, on a stand-in engine that answers every step at once
(tests/server/instant_engine.py): requests of every kind sharing steps each get what they get alone
while the plain greedy rows of a step are chosen together and short prompts join the step; the expert cache's counters are read
once per engine call, and the metrics still count all of its work."""
from __future__ import annotations


import pytest

pytest.importorskip("torch")
from instant_engine import BytesTokenizer, InstantEngine  # noqa: E402
from moestream.engine.types import SamplingParams  # noqa: E402
from moestream.server.metrics import ServerMetrics  # noqa: E402
from moestream.server.jobs import Choice, Finished, Job  # noqa: E402
from job_events import event_collector  # noqa: E402
from moestream.server.worker import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(120)

VOCAB = 2048
GREEDY = SamplingParams()
# (prompt, max tokens, sampling, stops, logprobs): plain greedy ones, and ones each row chooses alone
REQUESTS = [([10 + i, 20, 30 + i], 12 + i, GREEDY, [], None) for i in range(6)] + [
    ([7, 8, 9], 14, SamplingParams(logit_bias=tuple((t, -100.0) for t in range(32, 80))), [], None),
    ([7, 8, 10], 10, SamplingParams(temperature=0.9, top_p=0.9, seed=5), [], None),
    ([7, 8, 11], 9, GREEDY, [], 2),
    ([7, 8, 12], 16, SamplingParams(frequency_penalty=1.5), [], None),
    ([7, 8, 13], 20, GREEDY, ["1`j", "zz"], None),  # its text alone is 7F|l<8HKA1`jF#,Be(}{
]


def run(requests, parallel: int, *, misses_per_row: int = 0, prompt_steps: bool = False):
    """Every request submitted at once; (each one's events, the engine, the metrics)."""
    engine = InstantEngine(parallel, BytesTokenizer(), vocab=VOCAB, misses_per_row=misses_per_row,
                           prompt_steps=prompt_steps)
    worker = Worker(lambda: engine, max_queue=len(requests), parallel=parallel)
    metrics = ServerMetrics(worker)
    worker.observers.append(metrics)
    worker.start()
    assert worker.wait_ready(30), worker.error
    outs, dones = [], []
    try:
        for prompt, max_new, sampling, stops, logprobs in requests:
            out, done, sink = event_collector()
            worker.submit(Job([Choice(prompt, max_new, sampling)], sink=sink, stops=stops, logprobs=logprobs))
            outs.append(out)
            dones.append(done)
        for done in dones:
            assert done.wait(60)
    finally:
        worker.shutdown(10)
    return outs, engine, metrics


def reply(events) -> tuple:
    end = events[-1]
    assert isinstance(end, Finished), end
    deltas = [e for e in events if hasattr(e, "text") and not isinstance(e, Finished)]
    logprobs = [(lp.token, lp.logprob, lp.top) for e in deltas for lp in e.logprobs]
    return "".join(e.text for e in deltas), end.finish_reason, end.completion_tokens, logprobs


def test_requests_sharing_steps_get_what_they_get_alone(monkeypatch):
    sizes = []
    real = InstantEngine.greedy_choices
    monkeypatch.setattr(InstantEngine, "greedy_choices", lambda self, rows: sizes.append(len(rows)) or real(self, rows))
    together, engine, _ = run(REQUESTS, parallel=4)
    alone = [run([r], parallel=2)[0][0] for r in REQUESTS]
    for i, (got, want) in enumerate(zip(together, alone)):
        assert reply(got) == reply(want), f"request {i} differs from its reply alone"
        assert reply(got)[0], f"request {i} wrote nothing"
    assert engine.rows / engine.steps > 2  # they did share steps
    assert max(sizes) >= 3  # and a step's plain greedy rows were chosen together
    assert reply(together[-1])[:2] == ("7F|l<8HKA", "stop")


def test_the_cache_counters_are_read_once_per_engine_call_and_all_counted():
    outs, engine, metrics = run(REQUESTS, parallel=4, misses_per_row=3)
    assert all(isinstance(out[-1], Finished) for out in outs)
    # one read when the scheduler starts, then one after each prefill and each step
    assert engine.stats_reads == 1 + engine.prefills + engine.steps
    assert metrics.registry.get_sample_value("moestream_expert_misses_total") == engine._misses > 0
    receipt = outs[0][-1].receipt
    assert receipt["misses"] > 0 and receipt["generated_tokens"] == outs[0][-1].completion_tokens


def test_short_prompts_join_the_decode_step_and_get_what_their_prefill_gives():
    """Where the engine runs a short prompt as a step of its own (CUDA), newcomers join the running
    rows' step instead of a prefill apart, while the step's 16 rows last; their replies are the
    replies their own prefill gives."""
    long_prompt = ([5] * 20, 6, GREEDY, [], None)  # more than a step's rows: prefilled apart
    requests = REQUESTS + [long_prompt]
    joined, engine, metrics = run(requests, parallel=4, prompt_steps=True)
    apart = [run([r], parallel=2)[0][0] for r in requests]
    for i, (got, want) in enumerate(zip(joined, apart)):
        assert reply(got) == reply(want), f"request {i} differs from its reply with a prefill of its own"
    assert engine.prefills == 1  # only the long prompt
    assert metrics.registry.get_sample_value("moestream_batch_size_count") < engine.steps  # some steps only prefill
    receipt = joined[0][-1].receipt
    assert receipt["prompt_tokens"] == 3 and receipt["prefill_s"] >= 0 and receipt["generated_tokens"] == 12
