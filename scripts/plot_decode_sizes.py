#!/usr/bin/env python
"""Plot decode speed against the device cache's size, from `moestream bench` JSON files.

    python scripts/plot_decode_sizes.py \
        --run "CPU share (auto)=docs/bench/h200/policy-auto-10.json,docs/bench/h200/policy-auto.json,docs/bench/h200/policy-auto-50.json" \
        --run "no share=docs/bench/h200/policy-off-10.json,docs/bench/h200/policy-off.json,docs/bench/h200/policy-off-50.json" \
        --line "llama.cpp, experts on 16 cores=39.5" --out docs/bench/h200/share-sizes.png

Each --run is LABEL=FILE[,FILE...]: every run of the files becomes one point (its cache size, its
decode tok/s), joined in order of size; each --line LABEL=TOK_S is a horizontal reference."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plot_runs import labelled_runs, new_axes, save_axes  # noqa: E402


def points(spec: str) -> tuple[str, list[float], list[float]]:
    """(label, cache sizes in %, tok/s) of every run in LABEL=FILE[,FILE...]."""
    label, files = spec.partition("=")[0], spec.partition("=")[2].split(",")
    found = []
    for path in files:
        for run in labelled_runs(f"{label}={path}", "plot_decode_sizes")[1]:
            size = str(run.get("cache_size", ""))
            if not size.endswith("%") or "decode" not in run:
                raise SystemExit(f"plot_decode_sizes: {path}: a run without a cache size in % or a decode")
            found.append((float(size.rstrip("%")), run["decode"]["tok_s"]))
    found.sort()
    return label, [s for s, _ in found], [t for _, t in found]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="LABEL=FILE[,FILE...] (bench output)")
    p.add_argument("--line", action="append", default=[], help="LABEL=TOK_S: a horizontal reference")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="Streamed decode, uniform routing (Qwen3-30B-A3B shape, 4-bit, H200)")
    args = p.parse_args(argv)
    fig, ax = new_axes()
    for spec in args.run:
        label, sizes, tok_s = points(spec)
        ax.plot(sizes, tok_s, marker="o", label=label)
        for s, t in zip(sizes, tok_s):
            ax.annotate(f"{t:.1f}", (s, t), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
    for spec in args.line:
        label, _, value = spec.partition("=")
        ax.axhline(float(value), linestyle="--", color="grey", alpha=0.7)
        ax.annotate(label, (ax.get_xlim()[0], float(value)), textcoords="offset points", xytext=(4, 4), fontsize=8)
    ax.set_xlabel("device cache (% of the routed experts)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    save_axes(fig, ax, args.out, args.title)


if __name__ == "__main__":
    main()
