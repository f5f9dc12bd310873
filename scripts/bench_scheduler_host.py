"""The batch scheduler's own host work per decode step (`serve --parallel N`), with the GPU taken out.

A stand-in engine answers `step_many` and `prefill` at once with precomputed float32 logits rows of
a realistic vocabulary (151,936: the Qwen3 shape), so everything left is host work: admission, the
Emitter's choice per row, detokenizing, stop matching, the metrics, delivering events, and (over
HTTP) the event loop answering the clients in the same process. Rounds of `--parallel` greedy
requests of 16 prompt ids and `--max-tokens` tokens, submitted together:

- worker: through the worker API (sinks that collect the events), one round after another;
- http: a real server (uvicorn in a thread, as `serve` runs it) and as many clients in another
  process, streamed or whole /v1/completions requests.

Host ms per step = the round's wall time / its decode steps (prefills included: they cost nothing
else here). A cProfile of the engine thread (worker mode) says where it goes.

    python scripts/bench_scheduler_host.py --out docs/bench/cpu-scheduler-host.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import multiprocessing
import pstats
import shlex
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import torch

from moestream.bench.machine import machine_info
from moestream.engine.emitter import Emitter
from moestream.engine.types import common_prefix
from moestream.errors import MoestreamError

VOCAB = 151_936
BANK = 64  # distinct logits rows; a row's greedy choice is a printable byte
PROMPT_TOKENS = 16


class BytesTokenizer:
    """Ids 0..255 are bytes; the rest decode to nothing (the bench only chooses printable bytes)."""

    eos_token_ids = frozenset({VOCAB - 1})
    vocab_size = VOCAB

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


class NoTextTokenizer(BytesTokenizer):
    """Like a synthetic model without tokenizer files: every text is empty."""

    def decode(self, ids: list[int]) -> str:
        return ""


class _Cache:
    def __init__(self) -> None:
        self.tokens: list[int] = []

    @property
    def length(self) -> int:
        return len(self.tokens)


class InstantEngine:
    """The engine interface the batch scheduler uses; every step and prefill returns at once."""

    def __init__(self, slots: int, tokenizer, *, vocab: int = VOCAB, max_context: int = 4096) -> None:
        g = torch.Generator().manual_seed(0)
        self.bank = torch.randn(BANK, vocab, generator=g)
        self.bank_tokens = [32 + (k * 37) % 95 for k in range(BANK)]  # printable ASCII
        self.bank[torch.arange(BANK), torch.tensor(self.bank_tokens)] = 20.0
        self.tokenizer = tokenizer
        self.caches = [_Cache() for _ in range(slots)]
        self.open_sequences: list[int] = []
        self.max_context = max_context
        self.model_name = "instant"
        self.device = torch.device("cpu")
        self.options = SimpleNamespace(verify=False)
        self.plan = SimpleNamespace(prefill_chunk=2048)
        self.args = SimpleNamespace(vocab_size=vocab)
        self.steps = self.prefills = self.rows = 0
        self.layers = 48
        self._hits = 0

    def _row(self, slot: int) -> torch.Tensor:
        tokens = self.caches[slot].tokens
        return self.bank[(len(tokens) * 7 + tokens[-1]) % BANK].unsqueeze(0)

    def open_sequence(self, prefix=None, *, slot=None) -> int:
        cache = self.caches[slot]
        cache.tokens = cache.tokens[:common_prefix(cache.tokens, prefix or [])]
        self.open_sequences.append(slot)
        return slot

    def close_sequence(self, seq: int) -> None:
        self.open_sequences.remove(seq)

    def check_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise MoestreamError("the prompt is empty")

    def prefill(self, prompt_ids, *, seq=0, should_stop=None, all_logits=False):
        cache = self.caches[seq]
        reuse = min(common_prefix(cache.tokens, prompt_ids), len(prompt_ids) - 1)
        cache.tokens = list(prompt_ids)
        self.prefills += 1
        self._hits += self.layers * 8 * (len(prompt_ids) - reuse)
        return self._row(seq), reuse

    def step_many(self, batch: dict[int, list[int]]) -> dict[int, torch.Tensor]:
        self.steps += 1
        self.rows += sum(len(t) for t in batch.values())
        out = {}
        for seq, tokens in batch.items():
            self.caches[seq].tokens += tokens
            out[seq] = self._row(seq)
        self._hits += self.layers * 8 * len(batch)
        return out

    def emitter(self, prompt_ids, state, *, sampling, logprobs=0, should_stop=None) -> Emitter:
        return Emitter(list(prompt_ids), state, sampling=sampling, logprobs=logprobs,
                       eos_ids=self.tokenizer.eos_token_ids, should_stop=should_stop, stop_at_eos=True)

    def rollback(self, length: int, *, seq: int = 0) -> None:
        del self.caches[seq].tokens[length:]

    def expert_stats(self) -> dict:
        """The shape of the expert cache's statistics, built as it builds them (all experts resident)."""
        per_layer = {str(layer): 1.0 for layer in range(self.layers)}
        return {"source": "file", "verify": False, "policy": "lru", "streaming": "resident", "partition": "shared",
                "slots": 6144, "slot_bytes": 6144 << 20, "total_experts": 6144, "host_slots": 0,
                "hits": self._hits, "misses": 0, "hit_rate": 1.0, "hit_rate_per_layer": per_layer, "evictions": 0,
                "bytes_read_disk": 0, "bytes_read_host": 0, "read_wait_s": 0.0, "disk_read_gb_s": None,
                "prefetch_issued": 0, "prefetch_used": 0}

    def memory_ledger(self) -> dict:
        return {"weights_bytes": 1 << 30, "kv_bytes": 1 << 28}

    def stats(self) -> dict:
        return {"model": self.model_name, "device": "cpu", "max_context": self.max_context,
                "experts": self.expert_stats()}

    def close(self) -> None:
        pass


def prompt_ids(client: int, request: int) -> list[int]:
    return [10 + (client * 977 + request * 131 + i * 7) % 1000 for i in range(PROMPT_TOKENS)]


def make_engine(parallel: int, tokenizer: str) -> InstantEngine:
    return InstantEngine(parallel, NoTextTokenizer() if tokenizer == "none" else BytesTokenizer())


# ---------------------------------------------------------------------------------------- worker API

def run_worker(parallel: int, rounds: int, max_tokens: int, tokenizer: str, profile: bool) -> dict:
    from moestream.engine.types import SamplingParams
    from moestream.server.batching import BatchScheduler
    from moestream.server.metrics import ServerMetrics
    from moestream.server.worker import Choice, Failed, Finished, Job, Worker

    engine = make_engine(parallel, tokenizer)
    profiler = cProfile.Profile() if profile else None
    original = BatchScheduler.run

    def run(self):  # the engine thread's loop, profiled
        if profiler is None:
            return original(self)
        profiler.enable()
        try:
            return original(self)
        finally:
            profiler.disable()

    BatchScheduler.run = run
    worker = Worker(lambda: engine, max_queue=4 * parallel, parallel=parallel)
    worker.observers.append(ServerMetrics(worker))
    worker.start()
    assert worker.wait_ready(30), worker.error
    per_round, texts = [], []
    try:
        for rnd in range(rounds + 1):  # round 0 warms up
            jobs, outs = [], []
            for c in range(parallel):
                out: list = []
                done = threading.Event()

                def sink(event, out=out, done=done):
                    out.append(event)
                    if isinstance(event, Failed) or (isinstance(event, Finished) and event.last):
                        done.set()

                job = Job([Choice(prompt_ids(c, rnd), max_tokens, SamplingParams(temperature=0.0))], sink=sink)
                jobs.append((job, done))
                outs.append(out)
            steps0, prefills0 = engine.steps, engine.prefills
            t0 = time.perf_counter()
            for job, _ in jobs:
                worker.submit(job)
            for _, done in jobs:
                done.wait(120)
            wall = time.perf_counter() - t0
            if rnd:
                per_round.append({"wall_s": wall, "steps": engine.steps - steps0,
                                  "prefills": engine.prefills - prefills0})
            texts = ["".join(getattr(e, "text", "") for e in out) for out in outs]
    finally:
        worker.shutdown(10)
        BatchScheduler.run = original
    result = _summary(per_round, parallel, max_tokens)
    result["sample_text"] = texts[0][:40]
    if profiler is not None:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(25)
        result["profile_tottime_top"] = _trim(buf.getvalue())
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("cumulative").print_stats(30)
        result["profile_cumulative_top"] = _trim(buf.getvalue())
    return result


def _trim(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.lstrip().startswith("ncalls")), 0)
    return lines[start:]


def _summary(per_round: list[dict], parallel: int, max_tokens: int) -> dict:
    wall = sum(r["wall_s"] for r in per_round)
    steps = sum(r["steps"] for r in per_round)
    return {"parallel": parallel, "rounds": len(per_round), "max_tokens": max_tokens, "decode_steps": steps,
            "prefills": sum(r["prefills"] for r in per_round), "wall_s": round(wall, 4),
            "host_ms_per_step": round(1000 * wall / max(1, steps), 3),
            "host_us_per_token": round(1e6 * wall / max(1, parallel * max_tokens * len(per_round)), 2)}


# ---------------------------------------------------------------------------------------- over HTTP

def _clients(url: str, clients: int, requests: int, max_tokens: int, stream: bool, offset: int) -> list[int]:
    import httpx

    def one(c: int) -> int:
        tokens = 0
        with httpx.Client(base_url=url, timeout=120) as http:
            for r in range(requests):
                body = {"prompt": prompt_ids(c, offset + r), "max_tokens": max_tokens, "temperature": 0}
                if stream:
                    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as reply:
                        reply.raise_for_status()
                        tokens += sum(1 for line in reply.iter_lines() if line.startswith("data: {"))
                else:
                    reply = http.post("/v1/completions", json=body)
                    reply.raise_for_status()
                    tokens += reply.json()["usage"]["completion_tokens"]
        return tokens

    with ThreadPoolExecutor(clients) as pool:
        return list(pool.map(one, range(clients)))


def run_http(parallel: int, requests: int, max_tokens: int, tokenizer: str, stream: bool) -> dict:
    import uvicorn

    from moestream.server.app import RequestDefaults, create_app
    from moestream.server.main import bind_socket
    from moestream.server.worker import Worker

    engine = make_engine(parallel, tokenizer)
    worker = Worker(lambda: engine, max_queue=4 * parallel, parallel=parallel).start()
    app = create_app(worker, api_key=None, model_id="instant", max_body_bytes=1 << 20, defaults=RequestDefaults(),
                     max_context=None)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning", log_config=None))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    assert worker.wait_ready(30), worker.error
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    ctx = multiprocessing.get_context("spawn")  # the clients do not share this process's interpreter lock
    per_round = []
    try:
        with ctx.Pool(1) as pool:
            pool.apply(_clients, (url, parallel, 1, max_tokens, stream, 10_000))  # warm up
            steps0, prefills0 = engine.steps, engine.prefills
            t0 = time.perf_counter()
            tokens = pool.apply(_clients, (url, parallel, requests, max_tokens, stream, 0))
            wall = time.perf_counter() - t0
    finally:
        server.should_exit = True
        worker.shutdown(10)
        thread.join(10)
        sock.close()
    steps = engine.steps - steps0
    per_round.append({"wall_s": wall, "steps": steps, "prefills": engine.prefills - prefills0})
    result = _summary(per_round, parallel, max_tokens * requests)
    result.update(stream=stream, clients=parallel, requests_per_client=requests, tokens=sum(tokens),
                  mean_batch=round(engine.rows / max(1, engine.steps), 2))
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parallel", default="16,32", help="batch sizes (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5, help="worker mode: rounds of --parallel requests")
    ap.add_argument("--requests", type=int, default=3, help="http mode: requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--tokenizer", choices=["none", "bytes"], default="bytes",
                    help="none: empty texts (a synthetic model); bytes: one character per token")
    ap.add_argument("--modes", default="worker,http-whole,http-stream")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine thread's host work")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for parallel in [int(p) for p in args.parallel.split(",")]:
        for mode in args.modes.split(","):
            if mode == "worker":
                r = run_worker(parallel, args.rounds, args.max_tokens, args.tokenizer, profile=False)
                r["mode"] = "worker"
                results.append(r)
                p = run_worker(parallel, args.rounds, args.max_tokens, args.tokenizer, profile=True)
                results[-1]["profile_tottime_top"] = p["profile_tottime_top"]
                results[-1]["profile_cumulative_top"] = p["profile_cumulative_top"]
            else:
                r = run_http(parallel, args.requests, args.max_tokens, args.tokenizer, stream=mode == "http-stream")
                r["mode"] = mode
                results.append(r)
            print(f"{r['mode']:12s} parallel {parallel:3d}: {r['host_ms_per_step']:.3f} host ms per step "
                  f"({r['decode_steps']} steps, {r['wall_s']:.3f} s)", flush=True)
    for r in results:
        if r["mode"] == "worker":
            print(f"\nparallel {r['parallel']}, worker, by own time:")
            print("\n".join(r["profile_tottime_top"][:18]))
    report = {"machine": machine_info(), "command": shlex.join(["python", *sys.argv]), "vocab": VOCAB,
              "tokenizer": args.tokenizer, "torch_threads": args.threads, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
