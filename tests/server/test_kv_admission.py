"""Admission by KV need (`serve --parallel N`, the real engine on a tiny model): a request starts only
where the KV pool holds its prompt plus its max_tokens beside what the running ones may still take;
else it waits (not refused) and starts when they end, with the tokens it gets alone; one that could
never fit is refused with a 400 naming its need and the pool's size."""
from __future__ import annotations

import httpx
import pytest

from conftest import live_server

pytest.importorskip("torch")
from moestream.engine.engine import Engine  # noqa: E402
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.engine.types import SamplingParams  # noqa: E402
from moestream.kv import pool as kv_pool  # noqa: E402
from moestream.server.jobs import Choice, Failed, Finished, Job, TextDelta  # noqa: E402
from job_events import event_collector  # noqa: E402
from moestream.server.worker import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(300)

CONTEXT = 128  # 8 blocks; two slots share 8 + 2 = 10


@pytest.fixture(scope="module")
def model_dir(tiny_packed_model):
    return tiny_packed_model("qwen3_moe", max_position_embeddings=1024)


def load(model_dir, sequences: int) -> Engine:
    return Engine.load(model_dir, options=EngineOptions(device="cpu", max_sequences=sequences, max_context=CONTEXT))


def no_eos(engine) -> SamplingParams:
    return SamplingParams(logit_bias=tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids))


class Widest:
    """An observer of the decode steps' row counts."""

    def __init__(self) -> None:
        self.rows = 0

    def batch_step(self, rows: int) -> None:
        self.rows = max(self.rows, rows)

    def __getattr__(self, name: str):
        return lambda *args: None


def test_a_request_waits_for_blocks_then_gets_what_it_gets_alone(model_dir):
    engine = load(model_dir, 2)
    assert engine.pool.groups[None].allocator.num_blocks == 10
    prompts = [engine.tokenizer.encode("def fibonacci(n):"), engine.tokenizer.encode("The quick brown fox")]
    sampling = no_eos(engine)
    worker, widest = Worker(lambda: engine, parallel=2), Widest()
    worker.observers.append(widest)
    worker.start()
    assert worker.wait_ready(60), worker.error
    try:
        runs = []
        for prompt in prompts:  # each needs 7 of the 10 blocks: the second waits for the first
            events, done, sink = event_collector()
            worker.submit(Job([Choice(prompt, 100 - len(prompt), sampling)], sink=sink))
            runs.append((events, done))
        for events, done in runs:
            assert done.wait(240)
            assert not [e for e in events if isinstance(e, Failed)], events
            assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["length"]
        texts = ["".join(e.text for e in events if isinstance(e, TextDelta)) for events, _ in runs]
        assert widest.rows == 1  # never side by side
        # a short one beside a long one: both fit, so both run at once
        widest.rows = 0
        short = [event_collector() for _ in range(2)]
        worker.submit(Job([Choice(prompts[0], 100 - len(prompts[0]), sampling)], sink=short[0][2]))
        worker.submit(Job([Choice(prompts[1], 8, sampling)], sink=short[1][2]))
        for events, done, _ in short:
            assert done.wait(240)
            assert not [e for e in events if isinstance(e, Failed)], events
        assert widest.rows == 2
    finally:
        worker.shutdown()
    reference = load(model_dir, 1)  # a pool of the whole context: the same tokens
    try:
        for prompt, text in zip(prompts, texts):
            reference.reset()
            gen = reference.generate(prompt, max_new_tokens=100 - len(prompt), sampling=sampling)
            assert reference.tokenizer.decode([e.token_id for e in gen]) == text
    finally:
        reference.close()


def test_a_request_that_never_fits_is_refused_with_400(model_dir, monkeypatch):
    monkeypatch.setattr(kv_pool, "full_blocks", lambda sequences, max_blocks, recurrent=False: 4)  # 64 tokens
    with live_server(load=lambda: load(model_dir, 2), parallel=2, model_id="tiny") as s:
        body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 100}
        r = httpx.post(f"{s.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        message = r.json()["error"]["message"]
        assert "KV blocks" in message and "the KV pool holds 4" in message
        r = httpx.post(f"{s.url}/v1/completions", json={**body, "max_tokens": 8}, timeout=120)
        assert r.status_code == 200, r.text


def test_an_echoed_prompt_counts_every_block_it_computes(model_dir):
    """A prompt whose log-probabilities are asked for (echo) is computed whole, sharing none of the
    blocks a running request holds: its admission counts them all, so neither runs out of blocks."""
    import time

    engine = load(model_dir, 2)  # 10 blocks
    text = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"
    ids = engine.tokenizer.encode(text * 4)
    assert len(ids) >= 3 * kv_pool.BLOCK_SIZE + 1
    prompt = ids[:3 * kv_pool.BLOCK_SIZE + 1]  # its 3 full blocks are published once it is prefilled
    sampling = no_eos(engine)
    worker = Worker(lambda: engine, parallel=2)
    worker.start()
    assert worker.wait_ready(60), worker.error
    try:
        first = event_collector()
        worker.submit(Job([Choice(prompt, 40, sampling)], sink=first[2]))  # 6 blocks (89 positions)
        deadline = time.monotonic() + 120
        while not any(isinstance(e, TextDelta) for e in first[0]) and not first[1].is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        # 6 blocks (90 positions), 3 of them the running one's prompt blocks it would share, were it not
        # scored whole: it waits for the first to end, as they would run out of blocks side by side
        second = event_collector()
        worker.submit(Job([Choice(prompt + [prompt[1]], 40, sampling, echo=True)], sink=second[2], logprobs=0))
        for events, done, _ in (first, second):
            assert done.wait(240)
            assert not [e for e in events if isinstance(e, Failed)], events
            assert [e.finish_reason for e in events if isinstance(e, Finished)] == ["length"]
    finally:
        worker.shutdown()


def test_a_padded_first_prefill_chunk_counts_its_padding(model_dir):
    """Where the engine pads a prompt's first prefill chunk to its graph's bucket (CUDA), the padding's
    rows take blocks too: admission and the sequence's promise count them."""
    from moestream.engine import prefill_graphs

    class Pads:  # the engine's padded prefill, as on CUDA: every chunk of more than 16 tokens
        def takes(self, tokens, start, seq):
            return start == 0 and tokens > 16

    engine = load(model_dir, 2)
    try:
        prompt = list(range(10, 50))  # 40 tokens: padded to 64
        assert engine.kv_room(prompt, 2).need == 3
        engine.prefill_graphs = Pads()
        assert prefill_graphs.bucket(len(prompt)) == 64
        assert engine.kv_room(prompt, 2).need == 4
        for seq in list(engine.open_sequences):
            engine.close_sequence(seq)
        seq = engine.open_sequence(prompt, tokens=len(prompt) + 2)
        assert engine.caches[seq].promise == 64
    finally:
        engine.prefill_graphs = None
        engine.close()
