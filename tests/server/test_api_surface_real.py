"""The same API surface on the real demo engine: count_tokens against the chat template and the
Messages route, the prefix cache in Messages usage, /tokenize pieces from the real vocabulary
(bytes where a character spans tokens), and /metrics' KV pool and latency figures with one
request at a time and with continuous batching."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import live_server

pytest.importorskip("torch")
from moestream.engine.engine import Engine  # noqa: E402
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.kv.pool import BLOCK_SIZE  # noqa: E402

pytestmark = pytest.mark.timeout(300)

SYSTEM = "Be brief."
USER = [{"role": "user", "content": "What is the capital of France?"}]
TOOLS = [{"name": "lookup", "description": "find an entry",
          "input_schema": {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}]


def demo(**kw) -> Engine:
    return Engine.load(None, options=EngineOptions(device="cpu", **kw))


@pytest.fixture(scope="module")
def real():
    with live_server(load=demo, model_id="demo") as s:
        yield s


@pytest.fixture(scope="module")
def http(real):
    with real.http() as c:
        yield c


def scrape(http) -> dict:
    samples = {}
    for family in text_string_to_metric_families(http.get("/metrics").text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def test_count_tokens_matches_the_template_and_the_messages_route(real, http):
    engine = real.worker.engine
    template = engine.tokenizer.chat_ids([{"role": "system", "content": SYSTEM}, *USER])
    body = {"model": "demo", "system": SYSTEM, "messages": USER}
    assert http.post("/v1/messages/count_tokens", json=body).json() == {"input_tokens": len(template)}
    for extra in ({}, {"tools": TOOLS}, {"tools": TOOLS, "tool_choice": {"type": "none"}}):
        counted = http.post("/v1/messages/count_tokens", json={**body, **extra}).json()["input_tokens"]
        usage = http.post("/v1/messages", json={**body, **extra, "max_tokens": 1, "temperature": 0}).json()["usage"]
        assert counted == usage["input_tokens"] + usage["cache_read_input_tokens"], extra
    with_tools = http.post("/v1/messages/count_tokens", json={**body, "tools": TOOLS}).json()["input_tokens"]
    assert with_tools > len(template)


def test_messages_usage_reads_the_prefix_cache(http):
    body = {"system": SYSTEM, "messages": USER, "max_tokens": 3, "temperature": 0}
    prompt = http.post("/v1/messages/count_tokens", json=body).json()["input_tokens"]
    http.post("/v1/messages", json=body)
    again = http.post("/v1/messages", json=body).json()["usage"]
    assert again["cache_read_input_tokens"] > 0 and again["cache_creation_input_tokens"] == 0
    assert again["input_tokens"] + again["cache_read_input_tokens"] == prompt and again["input_tokens"] >= 1
    longer = {**body, "messages": USER + [{"role": "assistant", "content": "Paris."},
                                          {"role": "user", "content": "And of Italy?"}]}
    grown = http.post("/v1/messages", json=longer).json()["usage"]
    # the conversation's start is reused, the new turn computed
    assert 0 < grown["cache_read_input_tokens"] <= prompt < grown["input_tokens"] + grown["cache_read_input_tokens"]


def test_tokenize_pieces_from_the_real_vocabulary(real, http):
    tokenizer = real.worker.engine.tokenizer
    text = "á hi <|im_start|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert http.post("/tokenize", json={"content": text}).json() == {"tokens": ids}
    assert http.post("/tokenize", json={"content": text, "add_special": True}).json() == \
        {"tokens": tokenizer.encode(text, add_special_tokens=True)}
    pieces = http.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    # 'á' is two byte tokens here: each piece is its byte, as a list; whole pieces are text
    assert pieces[0]["piece"] == [0xC3] and pieces[1]["piece"] == [0xA1]
    assert pieces[-1]["piece"] == "<|im_start|>"
    joined = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert joined.decode("utf-8") == text
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"content": text}
    vocab = tokenizer.vocab_size
    assert http.post("/detokenize", json={"tokens": [vocab]}).status_code == 400


def test_kv_pool_gauge_follows_the_engine(real, http):
    http.post("/v1/completions", json={"prompt": "The first words of a story", "max_tokens": 5, "temperature": 0})
    real.wait_idle()
    samples = scrape(http)
    engine = real.worker.engine
    cached = engine.caches[0].length
    assert cached > 0
    assert samples[("moestream_kv_blocks_used", ())] == -(-cached // BLOCK_SIZE)
    assert samples[("moestream_kv_blocks_total", ())] == -(-engine.max_context // BLOCK_SIZE)  # one sequence


def test_latency_figures_with_continuous_batching():
    prompts = ["Once upon a time", "def fibonacci(n):", "The quick brown fox", "import os"]
    with live_server(load=lambda: demo(max_sequences=2), parallel=2, model_id="demo") as s, s.http() as http:
        no_eos = {str(t): -100 for t in s.worker.engine.tokenizer.eos_token_ids}

        def ask(i: int, max_tokens: int) -> int:
            with s.http() as h:
                body = {"prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0, "logit_bias": no_eos}
                return h.post("/v1/completions", json=body).json()["usage"]["completion_tokens"]

        with ThreadPoolExecutor(4) as pool:
            long = pool.submit(ask, 0, 60)
            while not s.worker.running:
                time.sleep(0.005)
            short = [pool.submit(ask, i, 2 + i) for i in range(1, 4)]
            for reply in short:
                reply.result()
            # each job's end refreshes the snapshot: the long request's blocks are held while it runs
            used_while_running = 0.0
            while not long.done():
                used_while_running = max(used_while_running, scrape(http)[("moestream_kv_blocks_used", ())])
                time.sleep(0.01)
            generated = [long.result()] + [reply.result() for reply in short]
        s.wait_idle()
        samples = scrape(http)
        total = s.worker.engine.pool.usage()[1]
        one_context = -(-s.worker.engine.max_context // BLOCK_SIZE)
    assert one_context < total < 2 * one_context  # two slots share less than two whole contexts (kv/pool.py)
    assert generated == [60, 3, 4, 5]
    assert samples[("moestream_time_to_first_token_seconds_count", ())] == 4
    assert samples[("moestream_inter_token_latency_seconds_count", ())] == sum(g - 1 for g in generated)
    assert samples[("moestream_inter_token_latency_seconds_sum", ())] > 0
    assert samples[("moestream_queue_seconds_count", ())] == 4
    assert samples[("moestream_kv_blocks_total", ())] == total
    assert used_while_running > 0
    # a batched request's slot gives its blocks back when it ends (its prefix stays reusable, not held)
    assert samples[("moestream_kv_blocks_used", ())] == 0
