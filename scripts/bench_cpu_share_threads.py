"""Does the CPU share's worker starve the thread that drives the engine? A CPU-device engine decodes
with `--cpu-experts 1` (the worker computes every repacked miss while the main thread loads the
others and waits) for each count of worker threads, against `off`; JSON out.

    python scripts/bench_cpu_share_threads.py --main-threads 1 --worker-threads 1 2 --out docs/bench/cpu_share_threads.json

Per setting: decode tok/s, the main thread's own time per token (decode time less the time it
waited for the worker), and the worker's kernel GB/s. Torch's intra-op thread count is per thread
(OpenMP), so the worker's does not change the main thread's; both still share the cores. Settings
are interleaved over --rounds rounds; medians. Default model: the demo (30 % cache, host tier all)."""
from __future__ import annotations

import argparse
import json
import os
import time

import torch

from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.engine.options import EngineOptions

PROMPT = "def fibonacci(n):"


def decode(model, *, share: str, main_threads: int, worker_threads: int, tokens: int, cache: str) -> dict:
    options = EngineOptions(device="cpu", cache_size=cache, host_cache_size="all", threads=main_threads,
                            cpu_experts=share)
    engine = Engine.load(model, options=options)
    try:
        if engine.experts.cpu is not None:
            engine.experts.cpu.set_threads(worker_threads)
        engine.prefill(engine.tokenizer.encode(PROMPT))  # fills the host tier and repacks, before timing
        before = engine.expert_stats()
        gen = engine.generate(engine.tokenizer.encode(PROMPT), max_new_tokens=tokens, stop_at_eos=False)
        for _ in gen:
            pass
        r, after = gen.result.receipt, engine.expert_stats()
    finally:
        engine.close()
    n = r["generated_tokens"]
    wait = after.get("cpu_wait_s", 0.0) - before.get("cpu_wait_s", 0.0)
    out = {"tok_s": r["decode_tok_s"], "main_ms_per_token": round((r["decode_s"] - wait) / n * 1e3, 3),
           "wait_ms_per_token": round(wait / n * 1e3, 3)}
    if "cpu_experts" in after:
        experts = after["cpu_experts"] - before["cpu_experts"]
        compute = after["cpu_compute_s"] - before["cpu_compute_s"]
        out.update({"cpu_experts_per_token": round(experts / n, 2),
                    "worker_gb_s": round((after["cpu_bytes"] - before["cpu_bytes"]) / compute / 1e9, 3) if compute else None,
                    "repacks_in_decode": after["cpu_repacks"] - before["cpu_repacks"]})
    return out


def median(values):
    values = sorted(v for v in values if v is not None)
    return values[len(values) // 2] if values else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=str(DEMO_MODEL))
    ap.add_argument("--cache-size", default="30%")
    ap.add_argument("--main-threads", type=int, default=1)
    ap.add_argument("--worker-threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    settings = [("off", 0)] + [("1", n) for n in args.worker_threads]
    runs: dict = {s: [] for s in settings}
    load = [os.getloadavg()[0]]
    for _ in range(args.rounds):
        for share, n in settings:
            runs[(share, n)].append(decode(args.model, share=share, main_threads=args.main_threads, worker_threads=n,
                                           tokens=args.tokens, cache=args.cache_size))
            load.append(os.getloadavg()[0])
    results = []
    for (share, n), rs in runs.items():
        row = {"cpu_experts": share, "main_threads": args.main_threads, "worker_threads": n or None,
               **{k: median([r.get(k) for r in rs]) for k in rs[0]}, "tok_s_all": [r["tok_s"] for r in rs]}
        results.append(row)
        print(json.dumps(row))
    out = {"what": "a CPU engine decoding with and without the CPU share's worker, per worker thread count",
           "model": os.path.basename(os.path.dirname(args.model.rstrip("/"))) if args.model == str(DEMO_MODEL) else args.model,
           "cache_size": args.cache_size, "tokens": args.tokens, "rounds": args.rounds, "torch": torch.__version__,
           "cores": len(os.sched_getaffinity(0)), "load_1min": [round(x, 2) for x in load],
           "command": "python scripts/bench_cpu_share_threads.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v is not None and k not in ("out", "model")),
           "results": results, "when": time.strftime("%Y-%m-%d %H:%M")}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
