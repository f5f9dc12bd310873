"""Speculative decoding on the demo model with each drafter, on prompts from its held-out split.

For every drafter and prompt it runs `moestream bench --draft DRAFTER --prompt TEXT --cache-sizes
100%,25% --warmup` in a fresh process: after a warm-up (the cache filled, a long prefill, a short
decode: else the first plain run pays for loading experts) bench decodes plain, speculative,
speculative, plain on the prompt at each cache size and reports both sides' tok/s, the speedup, the
accept rate and whether all four runs gave the same tokens. The prompts are the first
--prompt-tokens tokens of test-split files (build/demo-data from `scripts/demo/train_demo.py
prepare`), chosen by a fixed seed. With --repeats N every (drafter, prompt) is run N times, the
rounds interleaved (each round runs every drafter and prompt once), and a prompt's speedup is the
median of its runs. Writes one JSON with every bench result, the machine's load before each run,
and means over the prompts.

    python scripts/bench_draft.py --out docs/bench/cpu/demo-drafters.json
    python scripts/bench_draft.py --device cuda --prompts-from docs/bench/cpu/demo-drafters.json --out r.json

--prompts-from takes the prompts an earlier run's JSON recorded (a machine without build/demo-data).
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

import numpy as np

from moestream.bench.machine import machine_info

ROOT = Path(__file__).resolve().parents[1]
DRAFTERS = {"ngram": "ngram", "draft model": str(ROOT / "moestream" / "demo" / "model" / "draft")}


def held_out_prompts(data: Path, count: int, tokens: int, seed: int) -> list[str]:
    """The first `tokens` tokens of `count` test-split files (files of at least 4x that), as text."""
    from tokenizers import Tokenizer

    ids = np.load(data / "test.npy").astype(np.int64)
    ends = np.flatnonzero(ids == 0)  # each file ends with <|endoftext|> (id 0)
    starts = np.concatenate([[0], ends[:-1] + 1])
    files = [(s, e) for s, e in zip(starts, ends) if e - s >= 4 * tokens]
    chosen = np.random.default_rng(seed).choice(len(files), size=count, replace=False)
    tok = Tokenizer.from_file(str(data / "tokenizer" / "tokenizer.json"))
    return [tok.decode(ids[files[i][0]:files[i][0] + tokens].tolist()) for i in sorted(chosen)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--data", default="build/demo-data")
    p.add_argument("--prompts", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=96)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--cache-sizes", default="100%,25%")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--drafters", default=",".join(DRAFTERS), help="which of: " + ", ".join(DRAFTERS))
    p.add_argument("--prompts-from", type=Path, help="an earlier run's JSON: take its prompts (no build/demo-data)")
    p.add_argument("--device", default="cpu", help="cpu (one compute thread) or cuda")
    p.add_argument("--repeats", type=int, default=1, help="runs of every (drafter, prompt), in interleaved rounds")
    args = p.parse_args()
    if args.prompts_from:
        prompts = json.loads(args.prompts_from.read_text())["prompts"][:args.prompts]
    else:
        prompts = held_out_prompts(Path(args.data), args.prompts, args.prompt_tokens, args.seed)
    threads = ["--threads", "1"] if args.device == "cpu" else []
    common = ["--device", args.device, *threads, "--warmup", "--prefill-tokens", "", "--decode-tokens", str(args.decode_tokens),
              "--cache-sizes", args.cache_sizes]
    runs = []
    rounds = [(r, name, i, prompt) for r in range(args.repeats) for name in args.drafters.split(",")
              for i, prompt in enumerate(prompts)]
    with tempfile.TemporaryDirectory() as tmp:
        for repeat, name, i, prompt in rounds:
            out = Path(tmp) / "bench.json"
            cmd = [sys.executable, "-m", "moestream", "bench", "--draft", DRAFTERS[name], "--prompt", prompt,
                   *common, "--out", str(out)]
            load = os.getloadavg()[0]
            subprocess.run(cmd, check=True, stdout=sys.stderr)
            result = json.loads(out.read_text())
            for run in result["runs"]:
                sp = run["speculative"]
                runs.append({"drafter": name, "prompt": i, "repeat": repeat, "cache_size": run["cache_size"],
                             "load_before": round(load, 2), "plain_tok_s": sp["plain_tok_s"],
                             "speculative_tok_s": sp["speculative_tok_s"], "speedup": sp["speedup"],
                             "accept_rate": sp["accept_rate"], "tokens_per_step": sp["tokens_per_step"],
                             "drafted": sp["drafted"], "accepted": sp["accepted"], "same_tokens": sp["same_tokens"],
                             "draft_lengths": sp["receipt"]["draft_lengths"],
                             "step_s_by_tokens": sp["receipt"]["step_s_by_tokens"],
                             "draft_s": sp["receipt"]["draft_s"], "verify_s": sp["receipt"]["verify_s"]})
                print(name, i, run["cache_size"], sp["speedup"], sp["accept_rate"], sp["same_tokens"], flush=True)
    summary = {}
    for r in runs:
        key = f"{r['drafter']} @ {r['cache_size']}"
        summary.setdefault(key, []).append(r)

    def per_prompt(v):  # a prompt's speedup: the median of its runs
        by = {}
        for r in v:
            by.setdefault(r["prompt"], []).append(r["speedup"])
        return [round(statistics.median(x), 3) for _, x in sorted(by.items())]

    summary = {k: {"mean_speedup": round(statistics.mean(per_prompt(v)), 3),
                   "speedups": per_prompt(v),
                   "accept_rate": round(sum(r["accepted"] for r in v) / max(1, sum(r["drafted"] for r in v)), 4),
                   "drafted": sum(r["drafted"] for r in v), "accepted": sum(r["accepted"] for r in v),
                   "same_tokens": all(r["same_tokens"] for r in v)} for k, v in summary.items()}
    doc = {"machine": {**machine_info(), "command": shlex.join(["python", *sys.argv]),
                       "affinity_cores": len(os.sched_getaffinity(0)), "load_at_end": round(os.getloadavg()[0], 2)},
           "bench_command": shlex.join(["moestream", "bench", "--draft", "DRAFTER", "--prompt", "PROMPT", *common]),
           "drafters": {k: DRAFTERS[k] for k in args.drafters.split(",")}, "repeats": args.repeats, "prompts": prompts,
           "runs": runs, "summary": summary}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    for k, v in summary.items():
        print(f"{k}: speedup {v['mean_speedup']} (per prompt {v['speedups']}), accept rate {v['accept_rate']}")


if __name__ == "__main__":
    main()
