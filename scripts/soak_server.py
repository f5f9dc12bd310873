#!/usr/bin/env python
"""Soak `moestream serve`: many clients for a bounded time, some leaving mid-stream.

    python scripts/soak_server.py --fake --clients 16 --seconds 60
    python scripts/soak_server.py --demo --parallel 8 --clients 64 --seconds 600 --max-queue 64 --device cpu
    python scripts/soak_server.py --model DIR --clients 16 --seconds 60 [--device cpu]
    python scripts/soak_server.py --url http://127.0.0.1:8080 --pid PID

It starts the server itself (the fake engine from tests/server, the demo model, or the model on
--model) on a free loopback port, unless --url points at one already running. Every prompt's
greedy reply is fetched once first; during the soak every reply, whole or streamed, must equal its
prompt's reply (nothing lost, cut or mixed up), streams must be well formed, a client that leaves
early must have seen a prefix of its reply, and no answer may be a 5xx other than 503
server_busy. The server's RSS is sampled each second and must stay flat. After the soak the queue
must drain, a client that leaves a long stream must leave the engine idle within --idle-limit
seconds (measured a few times, on the otherwise idle server), and the server must stop on SIGTERM
with exit status 0. Prints a JSON summary; exits 1 on any failure.
"""
from __future__ import annotations

import argparse
import json
import random
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    counts: dict = field(default_factory=dict)
    failures: list = field(default_factory=list)
    latencies: list = field(default_factory=list)
    first_tokens: list = field(default_factory=list)  # a stream's seconds to its first content
    tokens: int = 0

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] = self.counts.get(key, 0) + n

    def add_tokens(self, n: int) -> None:
        with self.lock:
            self.tokens += n

    def fail(self, message: str) -> None:
        with self.lock:
            self.counts["failures"] = self.counts.get("failures", 0) + 1
            if len(self.failures) < 20:
                self.failures.append(message)


def start_server(args) -> tuple[subprocess.Popen, str]:
    if args.fake:  # the fake engine has no sequence slots: one generation at a time
        cmd = [sys.executable, str(REPO / "tests" / "server" / "fake_server.py"), "--token-delay",
               str(args.token_delay), "--eos-every", "0"]
    else:
        model = ["--model", args.model] if args.model else []  # none: the demo model
        cmd = [sys.executable, "-m", "moestream", "serve", *model, "--parallel", str(args.parallel),
               *args.engine_flags]
    cmd += ["--host", "127.0.0.1", "--port", "0", "--max-queue", str(args.max_queue), "--log-level", "warning"]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    line = proc.stdout.readline()
    match = re.search(r"http://127\.0\.0\.1:\d+", line)
    if not match:
        proc.kill()
        raise SystemExit(f"soak: the server did not start: {line!r}")
    return proc, match.group(0)


def wait_ready(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit("soak: the server never became ready")


def body_for(prompt: str, args, stream: bool) -> dict:
    return {"model": "soak", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
            "max_tokens": args.max_tokens, "stream": stream, "stream_options": {"include_usage": True}}


def whole_request(client: httpx.Client, url: str, prompt: str, args) -> dict:
    r = client.post(url + "/v1/chat/completions", json=body_for(prompt, args, False))
    return {"status": r.status_code, "json": r.json() if r.headers.get("content-type", "").startswith(
        "application/json") else None, "headers": r.headers}


def check_status(status: int, payload, headers, tally: Tally, what: str) -> bool:
    if status == 200:
        return True
    if status >= 500 and not (status == 503 and payload and payload.get("error", {}).get("code") == "server_busy"):
        tally.count("status_5xx")
    if status == 503 and payload and payload.get("error", {}).get("code") == "server_busy":
        retry = int(headers.get("retry-after", "0"))
        if not 1 <= retry <= 10:
            tally.fail(f"{what}: 503 with Retry-After {retry}")
        tally.count("busy_503")
        return False
    tally.fail(f"{what}: status {status}: {payload}")
    return False


def client_loop(index: int, url: str, prompts: list[str], reference: dict, args, deadline: float,
                tally: Tally) -> None:
    rng = random.Random(args.seed * 1000 + index)
    with httpx.Client(timeout=httpx.Timeout(120.0)) as client:
        while time.monotonic() < deadline:
            prompt = rng.choice(prompts)
            expected = reference[prompt]
            stream = rng.random() < 0.6
            leave = stream and rng.random() < args.disconnect_fraction
            started = time.monotonic()
            try:
                if not stream:
                    r = whole_request(client, url, prompt, args)
                    if not check_status(r["status"], r["json"], r["headers"], tally, "whole"):
                        continue
                    text = r["json"]["choices"][0]["message"]["content"]
                    if text != expected["text"]:
                        tally.count("mixed")
                        tally.fail(f"whole reply differs for prompt {prompt!r}")
                    if r["json"]["usage"]["completion_tokens"] != expected["tokens"]:
                        tally.fail("whole reply: wrong completion_tokens")
                    tally.count("whole_ok")
                    tally.add_tokens(expected["tokens"])
                else:
                    stream_request(client, url, prompt, expected, args, leave, rng, tally)
            except httpx.HTTPError as exc:
                tally.count("lost")
                tally.fail(f"transport error: {type(exc).__name__}: {exc}")
            with tally.lock:
                tally.latencies.append(time.monotonic() - started)


def stream_request(client, url, prompt, expected, args, leave, rng, tally) -> None:
    stop_after = rng.randint(1, 8) if leave else None
    started = time.monotonic()
    with client.stream("POST", url + "/v1/chat/completions", json=body_for(prompt, args, True)) as r:
        if r.status_code != 200:
            r.read()
            check_status(r.status_code, r.json(), r.headers, tally, "stream")
            return
        text, ids, finishes, events, done = "", set(), [], 0, False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                tally.count("lost")
                tally.fail(f"stream error event: {chunk['error']}")
                return
            ids.add(chunk["id"])
            for choice in chunk["choices"]:
                if not text and choice["delta"].get("content"):
                    with tally.lock:
                        tally.first_tokens.append(time.monotonic() - started)
                text += choice["delta"].get("content") or ""
                if choice["finish_reason"]:
                    finishes.append(choice["finish_reason"])
            events += 1
            if stop_after is not None and events >= stop_after:
                break  # leave mid-stream: closing the response drops the connection
    if stop_after is not None and not done:
        if not expected["text"].startswith(text):
            tally.count("mixed")
            tally.fail(f"an abandoned stream's text is not a prefix of its reply ({prompt!r})")
        tally.count("left_mid_stream")
        return
    if not done or len(finishes) != 1 or len(ids) != 1:
        tally.count("lost")
        tally.fail(f"malformed stream: done={done} finishes={finishes} ids={len(ids)}")
    elif text != expected["text"]:
        tally.count("mixed")
        tally.fail(f"streamed reply differs for prompt {prompt!r}")
    else:
        tally.count("stream_ok")
        tally.add_tokens(expected["tokens"])


def percentiles(values: list[float]) -> dict:
    """p50, p95, p99 of values (seconds, rounded to ms); None each where there are none."""
    ordered = sorted(values)
    return {f"p{q}": round(ordered[int(q / 100 * (len(ordered) - 1))], 3) if ordered else None for q in (50, 95, 99)}


def idle_after_disconnect(url: str, args) -> float:
    """Seconds from a client leaving a long stream until the server runs and queues nothing."""
    body = {**body_for("Count slowly from one to one thousand.", args, True), "max_tokens": args.probe_tokens}
    with httpx.Client(timeout=120) as client:
        with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                raise RuntimeError(f"status {r.status_code}")
            events = 0
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events >= 3:
                        break
        left = time.monotonic()  # the response is closed: the connection is gone
        while time.monotonic() - left < 10:
            queue = client.get(url + "/health").json()["queue"]
            if queue["waiting"] == 0 and queue["running"] == 0 and not queue["busy"]:
                return time.monotonic() - left
            time.sleep(0.01)
    return float("inf")


def sample_rss(pid: int | None, samples: list, stop: threading.Event) -> None:
    if pid is None:
        return
    import psutil
    process = psutil.Process(pid)
    while not stop.wait(1.0):
        try:
            samples.append((time.monotonic(), process.memory_info().rss))
        except psutil.Error:
            return


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = parser.add_mutually_exclusive_group(required=True)
    where.add_argument("--fake", action="store_true", help="start a server around the test suite's fake engine")
    where.add_argument("--model", help="start `moestream serve --model DIR`")
    where.add_argument("--demo", action="store_true", help="start `moestream serve` on the built-in demo model")
    where.add_argument("--url", help="soak a server that is already running (loopback only)")
    parser.add_argument("--pid", type=int, help="with --url: the server's pid, to watch its RSS")
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--prompts", type=int, default=24, help="distinct prompts")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--max-queue", type=int, default=16, help="for a server this script starts")
    parser.add_argument("--parallel", type=int, default=1, help="--demo/--model: requests generated together")
    parser.add_argument("--idle-probes", type=int, default=5, help="disconnect probes after the soak")
    parser.add_argument("--idle-limit", type=float, default=1.0,
                        help="seconds the engine may take to be idle after a client leaves")
    parser.add_argument("--probe-tokens", type=int, default=1000, help="max_tokens of a disconnect probe")
    parser.add_argument("--token-delay", type=float, default=0.002, help="--fake: seconds per token")
    parser.add_argument("--disconnect-fraction", type=float, default=0.25,
                        help="share of streams the client leaves after a few events")
    parser.add_argument("--rss-growth-mb", type=float, default=25.0, help="most RSS growth allowed")
    parser.add_argument("--rss-every", type=float, default=30.0, help="seconds between RSS timeline points")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--json", type=Path, help="also write the summary here")
    args, engine_flags = parser.parse_known_args(argv)
    args.engine_flags = engine_flags  # e.g. --device cpu, passed to `moestream serve`
    if engine_flags and (args.fake or args.url):
        parser.error(f"unrecognized arguments: {' '.join(engine_flags)}")
    if args.url and not re.match(r"https?://(127\.\d+\.\d+\.\d+|localhost|\[::1\])(:\d+)?/?$", args.url):
        parser.error("--url must be a loopback address")

    proc = None
    if args.url:
        url, pid = args.url.rstrip("/"), args.pid
    else:
        proc, url = start_server(args)
        pid = proc.pid
    try:
        wait_ready(url, 300)
        prompts = [f"Soak prompt {i}: tell me something about the number {i * 7919 % 1000}." for i in range(args.prompts)]
        reference = {}
        with httpx.Client(timeout=120) as client:
            for prompt in prompts:
                r = whole_request(client, url, prompt, args)
                if r["status"] != 200:
                    raise SystemExit(f"soak: reference request failed: {r['status']} {r['json']}")
                reference[prompt] = {"text": r["json"]["choices"][0]["message"]["content"],
                                     "tokens": r["json"]["usage"]["completion_tokens"]}
        if len({v["text"] for v in reference.values()}) < len(prompts) // 2:
            print("soak: warning: many prompts share a reply; mix-ups may go unseen", file=sys.stderr)

        tally = Tally()
        rss: list = []
        stop = threading.Event()
        sampler = threading.Thread(target=sample_rss, args=(pid, rss, stop), daemon=True)
        sampler.start()
        started = time.monotonic()
        deadline = started + args.seconds
        clients = [threading.Thread(target=client_loop, args=(i, url, prompts, reference, args, deadline, tally))
                   for i in range(args.clients)]
        for t in clients:
            t.start()
        for t in clients:
            t.join(args.seconds + 300)
        elapsed = time.monotonic() - started
        stop.set()

        # afterwards: nothing left running or queued
        drained = False
        for _ in range(50):
            health = httpx.get(url + "/health", timeout=5).json()
            if health["queue"]["waiting"] == 0 and not health["queue"]["busy"]:
                drained = True
                break
            time.sleep(0.1)
        if not drained:
            tally.fail("the queue did not drain after the soak")
        idle = []
        for _ in range(args.idle_probes if drained else 0):
            try:
                idle.append(idle_after_disconnect(url, args))
            except (httpx.HTTPError, RuntimeError) as exc:
                tally.fail(f"disconnect probe: {type(exc).__name__}: {exc}")
        if idle and max(idle) > args.idle_limit:
            tally.fail(f"the engine took {max(idle):.2f} s to be idle after a client left")

        summary = {
            "server": "fake engine" if args.fake else (args.model or "demo model") if not args.url else args.url,
            "parallel": None if args.url else 1 if args.fake else args.parallel,
            "max_queue": None if args.url else args.max_queue, "max_tokens": args.max_tokens,
            "clients": args.clients, "seconds": round(elapsed, 1), "requests": len(tally.latencies),
            **tally.counts, "completion_tokens": tally.tokens,
            "tokens_per_second": round(tally.tokens / elapsed, 1),
            **{f"latency_{name}_s": value for name, value in percentiles(tally.latencies).items()},
            **{f"first_token_{name}_s": value for name, value in percentiles(tally.first_tokens).items()},
            "idle_after_disconnect_s": [round(v, 3) for v in idle],
        }
        for key in ("lost", "mixed", "status_5xx"):
            summary.setdefault(key, 0)
        if rss:
            tenth = max(1, len(rss) // 10)
            early = statistics.median(v for _, v in rss[:tenth])
            late = statistics.median(v for _, v in rss[-tenth:])
            growth = (late - early) / 2**20
            summary.update(rss_start_mb=round(early / 2**20, 1), rss_end_mb=round(late / 2**20, 1),
                           rss_max_mb=round(max(v for _, v in rss) / 2**20, 1), rss_growth_mb=round(growth, 1))
            # memory over time: one sample (MB) every --rss-every seconds of the soak
            t0, timeline, next_t = rss[0][0], [], 0.0
            for t, v in rss:
                if t - t0 >= next_t:
                    timeline.append([round(t - t0), round(v / 2**20, 1)])
                    next_t += args.rss_every
            summary["rss_timeline_s_mb"] = timeline
            if growth > args.rss_growth_mb:
                tally.fail(f"RSS grew by {growth:.1f} MB")
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            code = proc.wait(60)
            summary["exit_status_after_sigterm"] = code
            if code != 0:
                tally.fail(f"the server exited with {code} after SIGTERM")
            proc = None
        summary["command"] = "python scripts/soak_server.py " + " ".join(sys.argv[1:] if argv is None else argv)
        summary["failures"] = tally.counts.get("failures", 0)
        summary["failure_examples"] = tally.failures
        text = json.dumps(summary, indent=1)
        print(text)
        if args.json:
            args.json.write_text(text + "\n")
        return 1 if tally.failures else 0
    finally:
        if proc is not None:
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
