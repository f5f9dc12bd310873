"""moestream on the CPU against llama.cpp's llama-bench on the same machine, in one call: prefill and
decode of the same shape, alternated A B A B (llama.cpp first in each round), each run its own
process, the load average before each run recorded. Writes JSON. moestream's prefill is the median of
two runs after one not counted (the first reads every expert from disk into the pool); llama-bench
runs its own warm-up.

The two models are the same shape with random 4-bit weights: `moestream synth --shape S --layers N
DIR` for moestream, and the llamacpp kit's `write_random_gguf.py --layers N --output-type q4_0` for
llama.cpp (Q4_0 matrices and head against moestream's affine 4-bit, group 64; both near-uniform
routing: moestream's side runs `--routing uniform`).

    python scripts/bench_cpu_llamacpp.py --model /tmp/q30l8 --gguf /tmp/q30l8.gguf \
        --llama-bench BUILD/bin/llama-bench --prefill-tokens 512 --decode-tokens 32 --rounds 2 \
        --out docs/bench/cpu-2core/qwen3-30b-a3b-8layers.json

`--before DIR` (a copy of another tree, e.g. `git archive main | tar -x -C DIR`) adds a third side,
"moestream before": that tree's moestream (PYTHONPATH=DIR) on the same model, in the same rounds.
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


def llama_cpp(args) -> list[str]:
    return [args.llama_bench, "-m", args.gguf, "-t", str(args.llama_threads), "-p", str(args.prefill_tokens),
            "-n", str(args.decode_tokens), "-r", "1", "-o", "json"]


def moestream(args, out: Path) -> list[str]:
    return [sys.executable, "-m", "moestream", "bench", "--model", os.path.abspath(args.model), "--device", "cpu",
            "--routing", "uniform",
            "--prefill-tokens", str(args.prefill_tokens), "--prefill-repeats", "2", "--decode-tokens",
            str(args.decode_tokens), "--no-progress", "--out", str(out), *shlex.split(args.moestream_args)]


def run_llama_cpp(args) -> dict:
    done = subprocess.run(llama_cpp(args), check=True, capture_output=True, text=True)
    rows = json.loads(done.stdout)  # one row per test and thread count: the best thread count's figure
    prefill = max((r for r in rows if r["n_prompt"] > 0 and r["n_gen"] == 0), key=lambda r: r["avg_ts"])
    decode = max((r for r in rows if r["n_gen"] > 0 and r["n_prompt"] == 0), key=lambda r: r["avg_ts"])
    return {"prefill_tok_s": round(prefill["avg_ts"], 2), "decode_tok_s": round(decode["avg_ts"], 2),
            "prefill_threads": prefill["n_threads"], "decode_threads": decode["n_threads"],
            "by_threads": {f'{r["n_threads"]} {"pp" if r["n_gen"] == 0 else "tg"}': round(r["avg_ts"], 2) for r in rows}}


def side(tree: str | None) -> dict:
    """subprocess.run's env and cwd for a side: another tree runs from its own folder (`python -m`
    imports from the working directory before PYTHONPATH)."""
    return {"env": {**os.environ, "PYTHONPATH": tree}, "cwd": tree} if tree else {}


def package_of(tree: str | None) -> str:
    """The moestream package a side imports."""
    return subprocess.run([sys.executable, "-c", "import moestream; print(moestream.__file__)"], check=True,
                          capture_output=True, text=True, **side(tree)).stdout.strip()


def run_moestream(args, tmp: str, i: int, tree: str | None = None) -> dict:
    out = Path(tmp) / f"moestream-{i}{'-before' if tree else ''}.json"
    subprocess.run(moestream(args, out), check=True, capture_output=True, text=True, **side(tree))
    run = json.loads(out.read_text())["runs"][0]
    return {"prefill_tok_s": run["prefill"][-1]["tok_s"], "decode_tok_s": run["decode"]["tok_s"],
            "threads": run["threads"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="moestream packed model (synth)")
    p.add_argument("--gguf", required=True, help="the same shape as a GGUF (the kit's write_random_gguf.py)")
    p.add_argument("--llama-bench", required=True, help="llama.cpp's llama-bench binary")
    p.add_argument("--llama-threads", default=",".join(str(t) for t in range(1, (os.cpu_count() or 1) + 1)),
                   help="llama-bench -t, comma-separated; each figure is the best of them (default: 1 to every core)")
    p.add_argument("--moestream-args", default="", help="more flags for moestream bench (default: its defaults)")
    p.add_argument("--prefill-tokens", type=int, default=512)
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--before", help="another tree's copy: a third side, its moestream on the same model")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = {"llama.cpp": [], **({"moestream before": []} if args.before else {}), "moestream": []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            for name in runs:
                load = os.getloadavg()[0]
                r = run_llama_cpp(args) if name == "llama.cpp" else \
                    run_moestream(args, tmp, i, args.before if name == "moestream before" else None)
                runs[name].append({**r, "load_before": round(load, 2)})
                print(name, runs[name][-1], flush=True)
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in ("prefill_tok_s", "decode_tok_s")}
               for name, rs in runs.items()}
    summary["moestream / llama.cpp"] = {k: round(summary["moestream"][k] / summary["llama.cpp"][k], 3)
                                        for k in ("prefill_tok_s", "decode_tok_s")}
    if args.before:
        summary["moestream / moestream before"] = {k: round(summary["moestream"][k] / summary["moestream before"][k], 3)
                                                   for k in ("prefill_tok_s", "decode_tok_s")}
    import moestream as package

    tree = subprocess.run(["git", "-C", str(Path(package.__file__).parent), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip() or None
    out = {"machine": {**machine_info(), "command": shlex.join([sys.executable, *sys.argv]),
                       "affinity_cores": len(os.sched_getaffinity(0))}, "moestream_commit": tree,
           "commands": {"llama.cpp": shlex.join(llama_cpp(args)), "moestream": shlex.join(moestream(args, Path("OUT.json")))},
           "packages": {name: package_of(args.before if name == "moestream before" else None)
                        for name in runs if name != "llama.cpp"}, "order": f"in each round: {', '.join(runs)}", "runs": runs, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
