"""`GET /metrics`: scraped from a really started server (fake engine, then the real demo engine),
parsed with prometheus_client's own parser, and checked to move as requests run."""
from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from conftest import live_server
from fake_engine import FakeEngine

CHAT = [{"role": "user", "content": "hello there"}]


def scrape(http) -> dict[tuple[str, tuple], float]:
    """Every sample as {(name, sorted labels): value}; fails on text the parser refuses."""
    answer = http.get("/metrics")
    assert answer.status_code == 200
    assert answer.headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(answer.text):
        for s in family.samples:
            samples[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return samples


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_move_with_requests_on_the_fake_engine():
    engine = FakeEngine(max_context=4096)
    with live_server(engine, api_key="sk-metrics") as server, server.http() as http, server.client() as sdk:
        before = scrape(http)
        assert value(before, "moestream_engine_state", state="ready") == 1.0
        assert value(before, "moestream_queue_capacity") == float("inf")  # no count limit unless set
        assert value(before, "moestream_queue_tokens_capacity") == server.worker.limits.max_tokens
        assert value(before, "moestream_generated_tokens_total") == 0.0
        replies = [sdk.chat.completions.create(model="m", messages=CHAT, max_tokens=n, temperature=0)
                   for n in (3, 5, 7)]
        server.wait_idle()
        http.get("/no/such/route")
        http.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer wrong"})
        after = scrape(http)

    generated = sum(r.usage.completion_tokens for r in replies)
    prompt = sum(r.usage.prompt_tokens for r in replies)
    assert generated == 3 + 5 + 7
    assert value(after, "moestream_generated_tokens_total") == generated
    assert value(after, "moestream_prompt_tokens_total") == prompt
    assert value(after, "moestream_choices_total", finish_reason="length") == 3
    assert value(after, "moestream_http_requests_total", method="POST", route="/v1/chat/completions",
                 status="200") == 3
    assert value(after, "moestream_http_requests_total", method="POST", route="/v1/chat/completions",
                 status="401") == 1
    assert value(after, "moestream_http_requests_total", method="GET", route="unmatched", status="404") == 1
    # the first scrape is counted by the time of the second
    assert value(after, "moestream_http_requests_total", method="GET", route="/metrics", status="200") == 1
    for phase in ("queue", "prefill", "decode"):
        assert value(after, f"moestream_{phase}_seconds_count") == 3, phase
        assert value(after, f"moestream_{phase}_seconds_bucket", le="+Inf") == 3, phase
    # the fake engine's receipts read 1000 disk and 500 host bytes and 3 misses per generated token
    assert value(after, "moestream_expert_read_bytes_total", tier="disk") == 1000 * generated
    assert value(after, "moestream_expert_read_bytes_total", tier="host") == 500 * generated
    assert value(after, "moestream_expert_misses_total") == 3 * generated
    assert value(after, "moestream_expert_hit_rate") == 0.75
    assert value(after, "moestream_jobs_total") == 3
    assert value(after, "moestream_queue_length") == 0
    assert value(after, "moestream_requests_running") == 0


def test_queue_and_running_gauges_while_busy():
    engine = FakeEngine(token_delay=0.05)
    with live_server(engine) as server, server.http() as http:
        import threading

        def ask() -> None:
            with server.http() as h:
                h.post("/v1/completions", json={"prompt": "x", "max_tokens": 20})

        threads = [threading.Thread(target=ask) for _ in range(3)]
        for t in threads:
            t.start()
        seen_running = seen_waiting = 0.0
        for _ in range(200):
            samples = scrape(http)
            seen_running = max(seen_running, value(samples, "moestream_requests_running"))
            seen_waiting = max(seen_waiting, value(samples, "moestream_queue_length"))
            if seen_running and seen_waiting:
                break
        for t in threads:
            t.join()
        server.wait_idle()
        idle = scrape(http)
    assert seen_running == 1.0
    assert seen_waiting >= 1.0
    assert value(idle, "moestream_requests_running") == 0.0
    assert value(idle, "moestream_queue_length") == 0.0
    assert value(idle, "moestream_queue_seconds_count") == 3
    # two of the three waited behind a running request of about a second
    assert value(idle, "moestream_queue_seconds_sum") > 0.5


def test_metrics_of_the_real_demo_engine():
    pytest.importorskip("torch")
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    with live_server(load=lambda: Engine.load(None, options=EngineOptions(device="cpu")),
                     model_id="demo") as server, server.http() as http:
        before = scrape(http)
        assert value(before, "moestream_expert_cache_slots") > 0
        misses_before = value(before, "moestream_expert_cache_misses_total")
        generated = 0
        for prompt in ("The first request", "and a second, different one"):
            reply = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6, "temperature": 0}).json()
            generated += reply["usage"]["completion_tokens"]
        server.wait_idle()
        after = scrape(http)

    assert generated > 0
    assert value(after, "moestream_generated_tokens_total") == generated
    assert value(after, "moestream_decode_seconds_count") == 2
    assert value(after, "moestream_prefill_seconds_sum") > 0
    # the demo's cache holds 30 % of its experts: the requests really read from disk
    disk = value(after, "moestream_expert_read_bytes_total", tier="disk")
    assert disk > 0
    assert value(after, "moestream_expert_misses_total") > 0
    assert value(after, "moestream_expert_cache_misses_total") > misses_before
    assert value(after, "moestream_expert_cache_read_bytes_total", tier="disk") >= disk
    hit_rate = value(after, "moestream_expert_hit_rate")
    assert 0.0 < hit_rate < 1.0
    hits = value(after, "moestream_expert_cache_hits_total")
    misses = value(after, "moestream_expert_cache_misses_total")
    assert hit_rate == pytest.approx(hits / (hits + misses), abs=1e-5)
