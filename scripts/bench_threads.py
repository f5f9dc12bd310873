"""Quick-start decode speed with the default compute threads against --threads 1 and 2.

Runs `moestream generate --prompt "def fibonacci(n):"` on the demo model, interleaving the
settings, and reads decode tok/s from each run's receipt. Writes JSON.

    python scripts/bench_threads.py --out docs/bench/cpu_threads.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from moestream.bench.machine import machine_info

SETTINGS = {"default": [], "threads 1": ["--threads", "1"], "threads 2": ["--threads", "2"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    base = [sys.executable, "-m", "moestream", "generate", "--prompt", "def fibonacci(n):"]
    results = {name: [] for name in SETTINGS}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.runs):
            for name, extra in SETTINGS.items():
                receipt = Path(tmp) / f"r-{i}.json"
                load = os.getloadavg()[0]
                subprocess.run(base + extra + ["--receipt", str(receipt)], check=True, capture_output=True)
                r = json.loads(receipt.read_text())
                results[name].append({"decode_tok_s": r["decode_tok_s"], "threads": r["threads"],
                                      "load_before": round(load, 2)})
                print(name, results[name][-1], flush=True)
    summary = {name: {"median_decode_tok_s": statistics.median(x["decode_tok_s"] for x in runs),
                      "threads_chosen": sorted({x["threads"] for x in runs})} for name, runs in results.items()}
    best = max(s["median_decode_tok_s"] for s in summary.values())
    summary["default_vs_best"] = round(summary["default"]["median_decode_tok_s"] / best, 3)
    out = {"machine": {**machine_info(), "command": None, "affinity_cores": len(os.sched_getaffinity(0))},
           "commands": {name: "moestream generate --prompt 'def fibonacci(n):' " + shlex.join(extra) + " --receipt R.json"
                        for name, extra in SETTINGS.items()},
           "runs": results, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
