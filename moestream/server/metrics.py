"""`GET /metrics` in Prometheus's text format: requests by route and status, tokens, the queue,
the batch, prefix reuse, time per phase, latency (time to first token, between tokens), the KV
pool's use, and what the expert cache did.

Three kinds of figures, each from where it is known:
- requests by route and status: an ASGI middleware, on the event loop;
- time to first token and between tokens: the worker thread, as each token comes out;
- tokens, phase times, prefix reuse and the cache's per-request work (bytes read per tier, read
  wait, misses): the receipts the worker thread reports as each choice ends, summed into counters;
  when requests are batched, the cache's work is reported per engine step instead (a step shared
  by several requests counts once), and each decode step's batch size;
- the queue, the running request, the KV pool's blocks and the cache's hit rate since load: read
  from the worker at scrape time (its stats snapshot, refreshed after every job, so no scrape ever
  calls the engine).

Each app owns its registry, so two servers in one process (tests) never share counters. Plain
numbers only: this module never imports torch.
"""
from __future__ import annotations

import logging
from typing import Any, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector
from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = logging.getLogger(__name__)

PREFIX = "moestream"
# Phases last from milliseconds (a queue wait, a reused prompt) to minutes (a long decode).
PHASE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# A decode step takes from about a millisecond (resident experts, a GPU) to seconds (experts from disk).
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
                 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 128)
REUSE_BUCKETS = (0, 16, 64, 256, 1024, 4096, 16384, 65536)
UNMATCHED_ROUTE = "unmatched"  # any path no route serves: one label, so scanners cannot grow the series


class ServerMetrics(Collector):
    """The app's metrics. The worker calls `job_started` and `choice_done` on its thread;
    prometheus_client's metrics are safe to update from any thread. As a collector it gives the
    figures read at scrape time: the queue, the running requests, the engine's cache since load."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(f"{PREFIX}_http_requests", "HTTP requests answered, by route and status code.",
                                ["method", "route", "status"], registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", "Prompt tokens of finished choices.", registry=r)
        self.prefill_tokens = Counter(f"{PREFIX}_prefill_tokens",
                                      "Prompt tokens computed (not reused from the KV cache).", registry=r)
        self.generated_tokens = Counter(f"{PREFIX}_generated_tokens", "Tokens generated.", registry=r)
        self.choices = Counter(f"{PREFIX}_choices", "Generations ended, by finish reason.", ["finish_reason"],
                               registry=r)
        self.queue_seconds = Histogram(f"{PREFIX}_queue_seconds", "Time a request waited in the queue.",
                                       buckets=PHASE_BUCKETS, registry=r)
        self.first_token_seconds = Histogram(f"{PREFIX}_time_to_first_token_seconds",
                                             "Time from a request's arrival in the queue to its first generated "
                                             "token.", buckets=PHASE_BUCKETS, registry=r)
        self.inter_token_seconds = Histogram(f"{PREFIX}_inter_token_latency_seconds",
                                             "Time between successive generated tokens of a choice.",
                                             buckets=TOKEN_BUCKETS, registry=r)
        self.prefill_seconds = Histogram(f"{PREFIX}_prefill_seconds", "Prefill time of one choice.",
                                         buckets=PHASE_BUCKETS, registry=r)
        self.decode_seconds = Histogram(f"{PREFIX}_decode_seconds", "Decode time of one choice.",
                                        buckets=PHASE_BUCKETS, registry=r)
        self.bytes_read = Counter(f"{PREFIX}_expert_read_bytes", "Expert bytes read for requests, by tier.",
                                  ["tier"], registry=r)
        self.read_wait = Counter(f"{PREFIX}_expert_read_wait_seconds",
                                 "Time requests waited on expert reads.", registry=r)
        self.misses = Counter(f"{PREFIX}_expert_misses", "Expert cache misses during requests.", registry=r)
        self.batch_sizes = Histogram(f"{PREFIX}_batch_size", "Sequences in each decode step (continuous batching).",
                                     buckets=BATCH_BUCKETS, registry=r)
        self.prefix_reuse = Histogram(f"{PREFIX}_prefix_reuse_tokens",
                                      "Prompt tokens of each choice reused from a cached prefix.",
                                      buckets=REUSE_BUCKETS, registry=r)
        self.last_batch = 0
        r.register(self)

    # ---- the worker's side (its thread)

    def job_started(self, queue_s: float) -> None:
        self.queue_seconds.observe(max(0.0, queue_s))

    def first_token(self, seconds: float) -> None:
        self.first_token_seconds.observe(max(0.0, seconds))

    def inter_token(self, seconds: float) -> None:
        self.inter_token_seconds.observe(max(0.0, seconds))

    def choice_done(self, prompt_tokens: int, generated: int, finish_reason: str, receipt: dict) -> None:
        self.prompt_tokens.inc(max(0, prompt_tokens))
        self.generated_tokens.inc(max(0, generated))
        self.choices.labels(finish_reason).inc()
        self.prefill_tokens.inc(max(0, _number(receipt.get("prefill_tokens"))))
        if "reused_tokens" in receipt:
            self.prefix_reuse.observe(max(0, _number(receipt["reused_tokens"])))
        if "prefill_s" in receipt:
            self.prefill_seconds.observe(max(0.0, _number(receipt["prefill_s"])))
        if "decode_s" in receipt and generated:
            self.decode_seconds.observe(max(0.0, _number(receipt["decode_s"])))
        self.expert_work(receipt)

    def batch_step(self, size: int) -> None:
        self.batch_sizes.observe(size)
        self.last_batch = size

    def expert_work(self, delta: dict) -> None:
        """The cache's work (bytes read per tier, read wait, misses): one choice's receipt, or one
        engine step of the batch scheduler."""
        for tier in ("disk", "host"):
            self.bytes_read.labels(tier).inc(max(0, _number(delta.get(f"bytes_read_{tier}"))))
        self.read_wait.inc(max(0.0, _number(delta.get("read_wait_s"))))
        self.misses.inc(max(0, _number(delta.get("misses"))))

    # ---- the HTTP side

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def collect(self) -> Iterator[Any]:
        w = self.worker
        yield _gauge("queue_length", "Requests waiting in the queue.", w.queue_depth)
        capacity = w.max_queue if w.max_queue is not None else float("inf")
        yield _gauge("queue_capacity", "Requests that may wait (--max-queue; +Inf: no count limit).", capacity)
        yield _gauge("queue_tokens", "Prompt tokens the waiting requests hold.", w.queue_tokens)
        yield _gauge("queue_tokens_capacity", "Prompt tokens the waiting requests may hold (--queue-tokens).",
                     w.limits.max_tokens)
        yield _gauge("requests_running", "Requests the engine is generating now (at most --parallel).", w.running)
        yield _gauge("parallel", "Requests that may generate together (--parallel).", w.parallel)
        yield _gauge("batch_size_current", "Sequences in the latest decode step (0 when idle).",
                     self.last_batch if w.running else 0)
        ready = GaugeMetricFamily(f"{PREFIX}_engine_state", "1 for the engine's current state.", labels=["state"])
        for state in ("loading", "ready", "failed", "stopped"):
            ready.add_metric([state], 1.0 if w.state == state else 0.0)
        yield ready
        done = CounterMetricFamily(f"{PREFIX}_jobs", "Requests the engine finished (any outcome).")
        done.add_metric([], float(w.jobs_done))
        yield done
        stats = w.stats_snapshot or {}
        experts = stats.get("experts") if isinstance(stats.get("experts"), dict) else {}
        hit_rate = experts.get("hit_rate", stats.get("hit_rate"))
        if hit_rate is not None:
            yield _gauge("expert_hit_rate", "The expert cache's hit rate since the engine loaded.", hit_rate)
        for key, name, text in (("hits", "expert_cache_hits", "Expert cache hits since load."),
                                ("misses", "expert_cache_misses", "Expert cache misses since load."),
                                ("evictions", "expert_cache_evictions", "Experts evicted since load."),
                                ("read_wait_s", "expert_cache_read_wait_seconds",
                                 "Time waited on expert reads since load.")):
            if key in experts:
                family = CounterMetricFamily(f"{PREFIX}_{name}", text)
                family.add_metric([], _number(experts[key]))
                yield family
        if "bytes_read_disk" in experts or "bytes_read_host" in experts:
            family = CounterMetricFamily(f"{PREFIX}_expert_cache_read_bytes", "Expert bytes read since load, by tier.",
                                         labels=["tier"])
            for tier in ("disk", "host"):
                family.add_metric([tier], _number(experts.get(f"bytes_read_{tier}")))
            yield family
        if "slots" in experts:
            yield _gauge("expert_cache_slots", "Expert slots in the device pool.", experts["slots"])
        kv = stats.get("kv") if isinstance(stats.get("kv"), dict) else {}
        if kv.get("blocks_total"):
            used, total = _number(kv.get("blocks_used")), _number(kv["blocks_total"])
            yield _gauge("kv_blocks_used", "KV pool blocks held by sequences (their cached tokens).", used)
            yield _gauge("kv_blocks_total", "KV pool blocks.", total)
            yield _gauge("kv_usage_ratio", "Share of the KV pool's blocks held by sequences.", used / total)


def _gauge(name: str, text: str, value: Any) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", text, value=_number(value))


def _number(value: Any) -> float:
    try:
        return float(value) if value is not None else 0.0
    except (TypeError, ValueError):
        return 0.0


class RequestCounter:
    """Counts every answer by method, route template (`/v1/models/{name:path}`, never the raw
    path) and status. Outermost, so refusals by the other middlewares (401, CORS preflights) count
    too: that is why the route is matched here, against the app's templates, and not taken from
    the router (which never sees a refused request)."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics, templates: list[str]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = [(template, compile_path(template)[0]) for template in templates]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # an exception before any answer is a 500

        async def send_status(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.requests.labels(scope.get("method", "?"), self.route_label(scope.get("path", "")),
                                         str(status[0])).inc()

    def route_label(self, path: str) -> str:
        return next((template for template, regex in self.routes if regex.match(path)), UNMATCHED_ROUTE)
