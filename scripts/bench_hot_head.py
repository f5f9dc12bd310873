"""What the hot-vocabulary head can save on the demo model (CPU): the median time of a decode step
with its head (`Engine.step`) and without (`Engine.step_hidden`), of the full head over one saved
row (`Engine.head_rows`) and of the model's head as one product over 4 rows, and of the hot head's
guess over lists of 4096 and 512 tokens, interleaved
run by run, every expert resident. Writes JSON.

    python scripts/bench_hot_head.py --out docs/bench/cpu-demo-hot-head.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from moestream.bench.machine import machine_info
from moestream.engine.engine import Engine
from moestream.engine.hot_head import HotHead, hot_vocabulary
from moestream.engine.options import EngineOptions


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=400)
    args = p.parse_args()
    engine = Engine.load(options=EngineOptions(device="cpu", threads=1, cache_size="all"))
    prompt = engine.tokenizer.encode("def fibonacci(n):")
    engine.prefill(prompt)
    start = engine.cache.length
    hot = {n: HotHead.of_model(engine.model, hot_vocabulary(prompt, engine.model.vocab_size, base_tokens=n))
           for n in (4096, 512)}
    times: dict[str, list[float]] = {"step": [], "step_hidden": [], "head_rows_1": [], "head_product_4_rows": [],
                                     **{f"hot_guess_{n}": [] for n in hot}}

    def timed(name, fn):
        t0 = time.perf_counter()
        out = fn()
        times[name].append(time.perf_counter() - t0)
        return out

    with torch.inference_mode():
        for _ in range(args.steps):
            engine.rollback(start)
            timed("step", lambda: engine.step([11]))
            engine.rollback(start)
            hidden = timed("step_hidden", lambda: engine.step_hidden([11]))
            timed("head_rows_1", lambda: engine.head_rows(hidden))
            four = hidden.expand(4, -1).contiguous()
            timed("head_product_4_rows", lambda: engine.model.head(four))
            for n, head in hot.items():
                timed(f"hot_guess_{n}", lambda: head.guess(hidden))
    engine.close()
    out = {"machine": {**machine_info(), "command": shlex.join(["python", *sys.argv]), "load_after": os.getloadavg()[0]},
           "vocab_size": engine.args.vocab_size, "hidden_size": engine.args.hidden_size, "steps": args.steps,
           "median_ms": {k: round(statistics.median(v) * 1e3, 4) for k, v in times.items()}}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["median_ms"]))


if __name__ == "__main__":
    main()
