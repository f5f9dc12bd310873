"""Server throughput under concurrent clients: total generated tok/s at 1, 4, 16, 32 clients.

Each client sends greedy /v1/completions requests one after another (its own prompts, so no two
clients share a prefix), for `--requests` requests; the figure is all completion tokens divided by
the wall time of the whole round. Against a running server (--url), or against servers this
script starts, one per --parallel value (`moestream serve --parallel P --max-queue 64 ...`), so
one JSON holds the one-at-a-time baseline and the batched server side by side.

    python scripts/bench_server_batching.py --parallel 1,32 --out docs/bench/cpu-demo-server-batching.json
    python scripts/bench_server_batching.py --url http://127.0.0.1:8080 --out result.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from moestream.bench.machine import machine_info

TOPICS = ["def fibonacci(n):", "The quick brown fox", "import os\nclass Thing:", "Once upon a time",
          "SELECT name FROM", "# Installation\n\n", "x = [1, 2, 3]\nfor", "Dear Sir or Madam,"]


def prompt(client: int, request: int, token_ids: bool) -> str | list[int]:
    """Text, or for models without a tokenizer (synthetic ones) 16 token ids; no two clients share a prefix."""
    if token_ids:
        return [10 + (client * 977 + request * 131 + i * 7) % 1000 for i in range(16)]
    return f"{TOPICS[(client + request) % len(TOPICS)]} #{client}-{request}"


def start_server(parallel: int, model: str | None, extra: list[str]) -> tuple[subprocess.Popen, str, list[str]]:
    command = [sys.executable, "-m", "moestream", "serve", "--port", "0", "--parallel", str(parallel),
               "--max-queue", "64", "--log-level", "warning", *(["--model", model] if model else []), *extra]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if "listening on " not in line:
        proc.kill()
        raise SystemExit(f"the server did not start: {line!r}")
    url = line.split("listening on ")[1].split("/v1")[0]
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit("the server did not become ready")
        time.sleep(0.2)
    return proc, url, ["moestream", *command[3:]]


def round_of(url: str, clients: int, requests: int, max_tokens: int, token_ids: bool) -> dict:
    def client(c: int) -> list[dict]:
        out = []
        with httpx.Client(base_url=url, timeout=600) as http:
            for r in range(requests):
                t0 = time.perf_counter()
                reply = http.post("/v1/completions", json={"prompt": prompt(c, r, token_ids), "max_tokens": max_tokens,
                                                           "temperature": 0})
                reply.raise_for_status()
                out.append({"tokens": reply.json()["usage"]["completion_tokens"],
                            "latency_s": time.perf_counter() - t0})
        return out

    t0 = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        done = [x for per_client in pool.map(client, range(clients)) for x in per_client]
    wall = time.perf_counter() - t0
    tokens = sum(x["tokens"] for x in done)
    return {"clients": clients, "requests": len(done), "completion_tokens": tokens, "wall_s": round(wall, 3),
            "total_tok_s": round(tokens / wall, 3),
            "median_latency_s": round(statistics.median(x["latency_s"] for x in done), 3)}


def batch_figures(url: str) -> dict:
    """The server's own batch-size histogram (sum and count of decode steps), from /metrics."""
    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("moestream_batch_size_") and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            values[name] = float(value)
    return {"steps": values.get("moestream_batch_size_count", 0.0), "rows": values.get("moestream_batch_size_sum", 0.0)}


def measure(url: str, clients: list[int], requests: int, max_tokens: int, token_ids: bool) -> list[dict]:
    round_of(url, 1, 2, max_tokens, token_ids)  # warm up: the first requests bring the experts in
    rows = []
    for n in clients:
        before = batch_figures(url)
        row = round_of(url, n, requests, max_tokens, token_ids)
        after = batch_figures(url)
        steps = after["steps"] - before["steps"]
        row["mean_batch_size"] = round((after["rows"] - before["rows"]) / steps, 3) if steps else None
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def over_one_request(runs: list[dict]) -> dict:
    """Each batched server's total tok/s per client count over the one-at-a-time server's with one client."""
    one = next((r["total_tok_s"] for run in runs if run.get("parallel") == 1 for r in run["rounds"]
                if r["clients"] == 1), None)
    if not one:
        return {}
    return {f"parallel {run['parallel']}": {str(r["clients"]): round(r["total_tok_s"] / one, 2) for r in run["rounds"]}
            for run in runs if run.get("parallel", 1) != 1}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="JSON file to write")
    p.add_argument("--url", default=None, help="a running server (default: start one per --parallel value)")
    p.add_argument("--parallel", default="1,32", help="servers to start: comma-separated --parallel values")
    p.add_argument("--model", default=None, help="packed model for the started servers (default: the demo model)")
    p.add_argument("--server-args", default="--device cpu", help="more flags for the started servers")
    p.add_argument("--clients", default="1,4,16,32", help="comma-separated client counts")
    p.add_argument("--baseline-clients", default=None,
                   help="client counts for the --parallel 1 server (default: --clients; it serves one at a time, "
                        "so more clients only queue)")
    p.add_argument("--requests", type=int, default=2, help="requests per client per round")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of every request")
    p.add_argument("--token-ids", action="store_true",
                   help="send token-id prompts (default: when --model has no tokenizer.json, e.g. a synthetic model)")
    args = p.parse_args()
    clients = [int(x) for x in args.clients.split(",")]
    token_ids = args.token_ids or (args.model is not None and not (Path(args.model) / "tokenizer.json").is_file())
    runs = []
    settings = {"requests_per_client": args.requests, "max_tokens": args.max_tokens, "temperature": 0,
                "model": args.model or "the demo model", "token_id_prompts": token_ids}

    def write(partial: bool) -> None:  # after each server: a run cut short keeps what it measured
        out = {"machine": {**machine_info(), "affinity_cores": len(os.sched_getaffinity(0)),
                           "load_average": [round(x, 2) for x in os.getloadavg()]},
               "command": shlex.join(["python", *sys.argv]), "settings": settings, "runs": runs,
               "over_one_request": over_one_request(runs),
               **({"partial": True} if partial else {})}
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")

    if args.url:
        runs.append({"server": args.url, "rounds": measure(args.url, clients, args.requests, args.max_tokens, token_ids)})
    else:
        for parallel in [int(x) for x in args.parallel.split(",")]:
            proc, url, command = start_server(parallel, args.model, shlex.split(args.server_args))
            try:
                print(f"# {shlex.join(command)}", flush=True)
                counts = clients if parallel != 1 or not args.baseline_clients else \
                    [int(x) for x in args.baseline_clients.split(",")]
                runs.append({"server_command": shlex.join(command), "parallel": parallel,
                             "rounds": measure(url, counts, args.requests, args.max_tokens, token_ids)})
            finally:
                proc.terminate()
                proc.wait(60)
            write(partial=True)
    write(partial=False)


if __name__ == "__main__":
    main()
