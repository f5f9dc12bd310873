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

import torch

from moestream.bench.instant_engine import VOCAB, BytesTokenizer, InstantEngine, NoTextTokenizer
from moestream.bench.machine import machine_info

PROMPT_TOKENS = 16


def prompt_ids(client: int, request: int) -> list[int]:
    return [10 + (client * 977 + request * 131 + i * 7) % 1000 for i in range(PROMPT_TOKENS)]


def make_engine(parallel: int, tokenizer: str, step_ms: float) -> InstantEngine:
    return InstantEngine(parallel, NoTextTokenizer() if tokenizer == "none" else BytesTokenizer(),
                         step_s=step_ms / 1000)


# ---------------------------------------------------------------------------------------- worker API

def run_worker(parallel: int, rounds: int, max_tokens: int, tokenizer: str, profile: bool, step_ms: float) -> dict:
    from moestream.engine.types import SamplingParams
    from moestream.server.batching import BatchScheduler
    from moestream.server.metrics import ServerMetrics
    from moestream.server.jobs import Choice, Job, event_collector
    from moestream.server.worker import Worker

    engine = make_engine(parallel, tokenizer, step_ms)
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
                out, done, sink = event_collector()
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
    result = _summary(per_round, parallel, max_tokens, step_ms)
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


def _summary(per_round: list[dict], parallel: int, max_tokens: int, step_ms: float) -> dict:
    steps = sum(r["steps"] for r in per_round)
    # the host's part: the wall time less the stand-in device time of the steps and prefills
    total = sum(r["wall_s"] for r in per_round)
    wall = total - step_ms / 1000 * (steps + sum(r["prefills"] for r in per_round))
    return {"parallel": parallel, "rounds": len(per_round), "max_tokens": max_tokens, "decode_steps": steps,
            "prefills": sum(r["prefills"] for r in per_round), "wall_s": round(total, 4), "host_s": round(wall, 4),
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


def run_http(parallel: int, requests: int, max_tokens: int, tokenizer: str, stream: bool, step_ms: float) -> dict:
    import uvicorn

    from moestream.server.app import RequestDefaults, create_app
    from moestream.server.main import bind_socket
    from moestream.server.worker import Worker

    engine = make_engine(parallel, tokenizer, step_ms)
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
            steps0, prefills0, rows0 = engine.steps, engine.prefills, engine.rows
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
    result = _summary(per_round, parallel, max_tokens * requests, step_ms)
    result.update(stream=stream, clients=parallel, requests_per_client=requests, tokens=sum(tokens),
                  mean_batch=round((engine.rows - rows0) / max(1, steps), 2))
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
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="a device's time per step and per prefill, slept without the interpreter lock "
                         "(the host's figure excludes it): the HTTP side then runs while the engine thread waits")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of the engine thread's host work")
    ap.add_argument("--out", help="write the JSON here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for parallel in [int(p) for p in args.parallel.split(",")]:
        for mode in args.modes.split(","):
            if mode == "worker":
                r = run_worker(parallel, args.rounds, args.max_tokens, args.tokenizer, profile=False,
                               step_ms=args.step_ms)
                r["mode"] = "worker"
                results.append(r)
                p = run_worker(parallel, args.rounds, args.max_tokens, args.tokenizer, profile=True,
                               step_ms=args.step_ms)
                results[-1]["profile_tottime_top"] = p["profile_tottime_top"]
                results[-1]["profile_cumulative_top"] = p["profile_cumulative_top"]
            else:
                r = run_http(parallel, args.requests, args.max_tokens, args.tokenizer, stream=mode == "http-stream",
                             step_ms=args.step_ms)
                r["mode"] = mode
                results.append(r)
            print(f"{r['mode']:12s} parallel {parallel:3d}: {r['host_ms_per_step']:.3f} host ms per step "
                  f"({r['decode_steps']} steps, {r['wall_s']:.3f} s)", flush=True)
    for r in results:
        if r["mode"] == "worker":
            print(f"\nparallel {r['parallel']}, worker, by own time:")
            print("\n".join(r["profile_tottime_top"][:18]))
    report = {"machine": machine_info(), "command": shlex.join(["python", *sys.argv]), "vocab": VOCAB,
              "tokenizer": args.tokenizer, "torch_threads": args.threads,
              "step_ms": args.step_ms, "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
        print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
