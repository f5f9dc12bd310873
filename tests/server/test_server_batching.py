"""`serve --parallel N` on the real engine and a tiny packed model: many concurrent requests (the
official openai SDK, streamed and whole) each get exactly what they get alone; prompts share the
slots' KV caches; a long prompt's prefill runs between the others' decode steps; a disconnect frees
its slot at once; beyond the slots and the queue, 503; /metrics shows the batches."""
from __future__ import annotations

import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from conftest import live_server
from serve_process import start_serve

pytest.importorskip("torch")
from moestream.engine.engine import Engine  # noqa: E402
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.engine.types import SamplingParams  # noqa: E402
from moestream.kv.pool import BLOCK_SIZE  # noqa: E402
from moestream.server.generation import choice_seed  # noqa: E402
from moestream.server.worker import Worker  # noqa: E402

pytestmark = pytest.mark.timeout(300)

MODEL_ID = "tiny-moe"
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nclass Thing:", "Hello world! 12",
           "Once upon a time", "x = [1, 2, 3]", "SELECT * FROM", "# Title\n\nSome"]


@pytest.fixture(scope="module")
def model_dir(tiny_packed_model):
    return tiny_packed_model("qwen3_moe", max_position_embeddings=1024)


def options(**kw) -> EngineOptions:
    return EngineOptions(device="cpu", **kw)


@pytest.fixture(scope="module")
def reference(model_dir):
    engine = Engine.load(model_dir, options=options())
    yield engine
    engine.close()


@pytest.fixture(scope="module")
def real(model_dir):
    with live_server(load=lambda: Engine.load(model_dir, options=options(max_sequences=4)), parallel=4,
                     max_queue=64, model_id=MODEL_ID) as s:
        yield s


def alone(engine, ids, max_new, sampling=SamplingParams()) -> str:
    engine.reset()  # no cached prefix: the reference does not depend on the order tests run in
    gen = engine.generate(ids, max_new_tokens=max_new, sampling=sampling)
    return engine.tokenizer.decode([e.token_id for e in gen])


def no_eos(engine) -> dict:
    """logit_bias that bans every end token: a request then runs to its max_tokens."""
    return {str(t): -100 for t in engine.tokenizer.eos_token_ids}


def test_concurrent_requests_get_what_they_get_alone(real, reference):
    """32 concurrent requests of every kind on 4 slots: joins and leaves at every step."""
    tok = reference.tokenizer
    jobs = []  # (kind, prompt, max_tokens, extra, expected)
    for i in range(32):
        prompt, max_new = PROMPTS[i % len(PROMPTS)], 6 + (i * 5) % 23
        kind = ["completion", "completion-stream", "chat", "chat-stream"][i % 4]
        if kind.startswith("chat"):
            messages = [{"role": "user", "content": prompt}]
            ids = tok.chat_ids(messages)
        else:
            ids = tok.encode(prompt)
        extra, sampling = {}, SamplingParams()
        if i % 6 == 5:  # seeded sampling: the same draws whatever runs beside it
            extra = {"temperature": 0.9, "top_p": 0.95, "seed": 1000 + i}
            sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=64, seed=1000 + i)
        expected = [alone(reference, ids, max_new, sampling)]
        if i == 7:  # n = 2: each choice with its own seed, side by side in slots of their own
            extra = {"n": 2, "temperature": 0.9, "seed": 7}
            expected = [alone(reference, ids, max_new, SamplingParams(temperature=0.9, top_k=64, top_p=0.95,
                                                                      seed=choice_seed(7, c))) for c in range(2)]
        jobs.append((kind, prompt, max_new, extra, expected))

    def run(job):
        kind, prompt, max_new, extra, _ = job
        with real.client() as c:
            kw = dict(model=MODEL_ID, max_tokens=max_new, **({"temperature": 0} | extra))
            if kind == "completion":
                r = c.completions.create(prompt=prompt, **kw)
                return [ch.text for ch in sorted(r.choices, key=lambda ch: ch.index)]
            if kind == "chat":
                r = c.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kw)
                return [ch.message.content for ch in sorted(r.choices, key=lambda ch: ch.index)]
            texts: dict[int, str] = {}
            if kind == "completion-stream":
                for chunk in c.completions.create(prompt=prompt, stream=True, **kw):
                    for ch in chunk.choices:
                        texts[ch.index] = texts.get(ch.index, "") + ch.text
            else:
                for chunk in c.chat.completions.create(messages=[{"role": "user", "content": prompt}], stream=True,
                                                       **kw):
                    for ch in chunk.choices:
                        texts[ch.index] = texts.get(ch.index, "") + (ch.delta.content or "")
            return [texts[k] for k in sorted(texts)]

    with ThreadPoolExecutor(len(jobs)) as pool:
        got = list(pool.map(run, jobs))
    for i, (job, texts) in enumerate(zip(jobs, got)):
        assert texts == job[4], f"request {i} ({job[0]}, {job[3]}) differs from its result alone"
    assert real.wait_idle(5) < 5


class Seen:
    """An observer of the decode steps' sizes and each choice's prompt tokens reused."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.reused: list[int] = []

    def batch_step(self, rows: int) -> None:
        self.steps.append(rows)

    def choice_done(self, prompt_tokens, generated, reason, receipt) -> None:
        self.reused.append(int(receipt.get("reused_tokens", 0)))

    def __getattr__(self, name: str):  # the other figures are not looked at here
        return lambda *args: None


def test_n_choices_run_side_by_side_as_they_run_one_after_another(real, model_dir, reference):
    """n=3 on 4 slots: the three choices share decode steps (the later two sharing the first's prompt
    blocks in the KV pool) and are the seeded choices --parallel 1 gives, one after another."""
    prompt = "Side by side: " + " ".join(f"w{i}" for i in range(20))
    assert len(reference.tokenizer.encode(prompt)) > 2 * BLOCK_SIZE
    body = dict(model=MODEL_ID, prompt=prompt, n=3, max_tokens=10, temperature=0.9, seed=4321,
                logit_bias=no_eos(reference))
    real.wait_idle(5)
    seen = Seen()
    real.worker.observers.append(seen)
    try:
        with real.client() as c:
            together = c.completions.create(**body)
    finally:
        real.worker.observers.remove(seen)
    with live_server(load=lambda: Engine.load(model_dir, options=options()), parallel=1, model_id=MODEL_ID) as one, \
            one.client() as c:
        apart = c.completions.create(**body)
    texts = [ch.text for ch in sorted(together.choices, key=lambda ch: ch.index)]
    assert texts == [ch.text for ch in sorted(apart.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) > 1  # each choice its own seed
    assert 3 in seen.steps  # one decode step ran the three
    assert sorted(seen.reused)[1] >= 2 * BLOCK_SIZE  # the later choices found the prompt's blocks


def test_metrics_show_batches_and_prefix_reuse(real, reference):
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(lambda p: real.client().completions.create(model=MODEL_ID, prompt=p, max_tokens=12,
                                                                 temperature=0), PROMPTS))
    text = httpx.get(real.url + "/metrics").text
    values = {line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line and not line.startswith("#")}
    steps, single = values["moestream_batch_size_count"], values['moestream_batch_size_bucket{le="1.0"}']
    assert steps > single, "no decode step ran more than one sequence"
    assert values["moestream_batch_size_sum"] / steps > 1.5
    assert values["moestream_parallel"] == 4 and values["moestream_requests_running"] == 0
    assert values["moestream_prefix_reuse_tokens_count"] >= len(PROMPTS)
    assert "moestream_queue_length" in values


def test_prefix_cache_is_shared_across_requests_not_only_the_last(real, reference):
    """A prompt finds the KV blocks of its prefix even after other requests ran in other slots."""
    real.wait_idle(5)
    c = real.client()
    base = "Long shared context: " + " ".join(f"item{i}" for i in range(40))
    first = c.completions.create(model=MODEL_ID, prompt=base, max_tokens=4, temperature=0)
    for p in PROMPTS[:2]:  # two unrelated requests in between (they take other, least recently used slots)
        c.completions.create(model=MODEL_ID, prompt=p, max_tokens=4, temperature=0)
    again = c.completions.create(model=MODEL_ID, prompt=base + " and more", max_tokens=6, temperature=0)
    shared = len(reference.tokenizer.encode(base))
    whole_blocks = (shared - 1) // BLOCK_SIZE * BLOCK_SIZE  # an ended request's full KV blocks are shared
    assert again.model_extra["timings"]["reused_tokens"] >= whole_blocks
    assert again.usage.prompt_tokens_details.cached_tokens >= whole_blocks
    assert again.choices[0].text == alone(reference, reference.tokenizer.encode(base + " and more"), 6)
    assert first.usage.prompt_tokens == shared


def test_disconnect_frees_the_slot_within_a_second(real, reference):
    real.wait_idle(5)
    ids = reference.tokenizer.encode(PROMPTS[1])
    other = {}

    def bystander():  # runs beside the request that goes away, and is not disturbed by it
        other["text"] = real.client().completions.create(model=MODEL_ID, prompt=PROMPTS[1], max_tokens=40,
                                                         temperature=0).choices[0].text

    thread = threading.Thread(target=bystander)
    thread.start()
    body = {"prompt": PROMPTS[0], "max_tokens": 900, "temperature": 0, "stream": True,
            "logit_bias": no_eos(reference)}
    with httpx.Client(base_url=real.url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for _ in range(3):
                next(lines)
            assert real.worker.running >= 1
        gone = time.monotonic()
    while real.worker.running > (1 if thread.is_alive() else 0):
        assert time.monotonic() - gone < 1.0, "the engine still ran the request a second after the disconnect"
        time.sleep(0.01)
    thread.join(60)
    assert other["text"] == alone(reference, ids, 40)
    assert real.wait_idle(5) < 5


def test_a_long_prompt_is_prefilled_between_decode_steps(model_dir, reference):
    """With 8-token prefill chunks, a running stream keeps decoding while a 150-token prompt is prefilled."""
    calls = []

    def load():
        engine = Engine.load(model_dir, options=options(max_sequences=2, prefill_chunk_tokens=8))
        prefill, step_many = engine.prefill, engine.step_many
        engine.prefill = lambda ids, **kw: calls.append(("prefill", kw["seq"])) or prefill(ids, **kw)
        engine.step_many = lambda batch: calls.append(("step", sorted(batch))) or step_many(batch)
        return engine

    long_prompt = " ".join(f"word{i}" for i in range(60))
    long_ids = reference.tokenizer.encode(long_prompt)
    assert len(long_ids) > 100
    with live_server(load=load, parallel=2, model_id=MODEL_ID) as s:
        body = {"prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "stream": True,
                "logit_bias": no_eos(reference)}
        with httpx.Client(base_url=s.url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as r:
                lines = r.iter_lines()
                next(lines)
                newcomer = s.client().completions.create(model=MODEL_ID, prompt=long_ids, max_tokens=5,
                                                         temperature=0)
        s.wait_idle(5)
    running_slot = calls[0][1]
    chunks = [i for i, c in enumerate(calls) if c[0] == "prefill" and c[1] != running_slot]
    assert len(chunks) == -(-len(long_ids) // 8)
    between = [c for c in calls[chunks[0]:chunks[-1]] if c[0] == "step"]
    assert len(between) >= len(chunks) - 1 and all(running_slot in c[1] for c in between)
    assert newcomer.choices[0].text == alone(reference, long_ids, 5)


def test_beyond_the_slots_and_the_queue_503(model_dir, reference):
    with live_server(load=lambda: Engine.load(model_dir, options=options(max_sequences=2)), parallel=2,
                     max_queue=1, model_id=MODEL_ID) as s:
        # (two prompts of 500 tokens fit the two slots' shared KV pool together; 900 would not)
        body = {"prompt": PROMPTS[0], "max_tokens": 500, "temperature": 0, "stream": True,
                "logit_bias": no_eos(reference)}
        with httpx.Client(base_url=s.url, timeout=60) as a, httpx.Client(base_url=s.url, timeout=60) as b:
            with a.stream("POST", "/v1/completions", json=body) as ra, \
                    b.stream("POST", "/v1/completions", json=body) as rb:
                assert ra.status_code == rb.status_code == 200
                deadline = time.monotonic() + 10
                while s.worker.running < 2:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                waiter = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", timeout=60, json={
                    "prompt": PROMPTS[2], "max_tokens": 2}))
                waiter.start()
                while s.worker.queue_depth < 1:
                    assert time.monotonic() < deadline
                    time.sleep(0.01)
                r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 2})
                assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy"
                assert "1 requests are already waiting" in r.json()["error"]["message"]
                assert 1 <= int(r.headers["Retry-After"]) <= 10
        waiter.join(60)
        assert s.wait_idle(5) < 5


def test_parallel_needs_an_engine_with_enough_slots(model_dir):
    worker = Worker(lambda: Engine.load(model_dir, options=options(max_sequences=1)), parallel=3).start()
    try:
        assert not worker.wait_ready(60)
        assert worker.state == "failed"
        assert "--parallel 3 needs an engine with 3 sequence slots" in worker.error
    finally:
        worker.shutdown(5)


def test_moestream_serve_parallel_process(model_dir, reference):
    """`python -m moestream serve --parallel 4` itself: 8 concurrent requests, each as alone."""
    proc, url = start_serve("--model", str(model_dir), "--device", "cpu", "--parallel", "4", "--queue-size", "8",
                            "--log-level", "warning")
    try:
        assert httpx.get(url + "/health").json()["queue"]["max"] == 8

        def run(prompt):
            r = httpx.post(url + "/v1/completions", timeout=60,
                           json={"prompt": prompt, "max_tokens": 16, "temperature": 0})
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(8) as pool:
            got = list(pool.map(run, PROMPTS))
        assert got == [alone(reference, reference.tokenizer.encode(p), 16) for p in PROMPTS]
        metrics = httpx.get(url + "/metrics").text
        assert "moestream_parallel 4.0" in metrics
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_parallel_and_queue_size_flags():
    from moestream.commands.serve import build_parser

    parser = build_parser(engine_arguments=False)
    args = parser.parse_args([])
    assert (args.parallel, args.max_queue) == (1, None)
    args = parser.parse_args(["--parallel", "16", "--queue-size", "3"])
    assert (args.parallel, args.max_queue) == (16, 3)
    with pytest.raises(SystemExit):
        parser.parse_args(["--parallel", "0"])
