"""Plain decoding against n-gram speculation on the demo model (CPU), in fresh processes.

Runs `moestream generate` on a code prompt that repeats itself and on the quick-start prompt,
interleaving the settings run by run, and reads decode tok/s, accept rate and tokens per
verification step from each run's JSON, and the CPU seconds of the whole process (load, prefill and
decode: steadier than wall time on a shared machine); checks every setting generated the same
tokens. Writes JSON.

    python scripts/bench_speculative.py --out docs/bench/cpu-demo-speculative.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from moestream.bench.machine import machine_info

PROMPTS = {
    "repetitive code": ("class Vector:\n    def add(self, other):\n        return Vector(self.x + other.x, self.y + other.y)\n"
                        "    def sub(self, other):\n        return Vector(self.x - other.x, self.y - other.y)\n"
                        "    def mul(self, other):\n"),
    "quick start": "def fibonacci(n):",
}
SETTINGS = {"plain": ["--draft", "off"], "ngram auto": ["--draft", "ngram"],
            "ngram k=4": ["--draft", "ngram", "--draft-tokens", "4"]}
COMMON = ["--max-new", "128", "--device", "cpu", "--threads", "1", "--json"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--runs", type=int, default=3)
    args = p.parse_args()
    results: dict = {prompt: {name: [] for name in SETTINGS} for prompt in PROMPTS}
    tokens: dict = {prompt: set() for prompt in PROMPTS}
    for i in range(args.runs):
        for prompt, text in PROMPTS.items():
            for name, extra in SETTINGS.items():
                load = os.getloadavg()[0]
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                cmd = [sys.executable, "-m", "moestream", "generate", "--prompt", text, *COMMON, *extra]
                out = subprocess.run(cmd, check=True, capture_output=True, text=True)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
                obj = json.loads(out.stdout.strip().splitlines()[-1])
                tokens[prompt].add(tuple(obj["token_ids"]))
                r, spec = obj["receipt"], obj["receipt"]["speculative"] or {}
                results[prompt][name].append({
                    "decode_tok_s": r["decode_tok_s"], "generated": r["generated_tokens"],
                    "hit_rate": r["hit_rate"], "misses": r["misses"], "load_before": round(load, 2),
                    "process_cpu_s": round(cpu_s, 3),
                    **{k: spec.get(k) for k in ("accept_rate", "tokens_per_step", "drafted", "accepted",
                                                 "draft_lengths", "step_s_by_tokens")}})
                print(prompt, name, results[prompt][name][-1]["decode_tok_s"], spec.get("accept_rate"), flush=True)
    summary = {}
    for prompt, by_setting in results.items():
        plain = statistics.median(x["decode_tok_s"] for x in by_setting["plain"])
        summary[prompt] = {"same_tokens_in_every_run": len(tokens[prompt]) == 1}
        for name, runs in by_setting.items():
            median = statistics.median(x["decode_tok_s"] for x in runs)
            summary[prompt][name] = {"median_decode_tok_s": median, "speedup": round(median / plain, 3),
                                     "median_process_cpu_s": statistics.median(x["process_cpu_s"] for x in runs),
                                     "min": min(x["decode_tok_s"] for x in runs),
                                     "max": max(x["decode_tok_s"] for x in runs)}
            if name != "plain":
                summary[prompt][name]["median_accept_rate"] = statistics.median(x["accept_rate"] for x in runs)
                summary[prompt][name]["median_tokens_per_step"] = statistics.median(x["tokens_per_step"] for x in runs)
    out = {"machine": {**machine_info(), "command": shlex.join(["python", *sys.argv]),
                       "affinity_cores": len(os.sched_getaffinity(0))},
           "commands": {f"{prompt} / {name}": shlex.join(["moestream", "generate", "--prompt", text, *COMMON, *extra])
                        for prompt, text in PROMPTS.items() for name, extra in SETTINGS.items()},
           "runs": results, "summary": summary}
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
