#!/usr/bin/env python
"""Plot prefill speed against prompt length, from `moestream bench --prefill-tokens ...` JSON files.

    python scripts/plot_prefill.py --run "workspace given back=docs/bench/h200/prefill-workspace-release.json" \
        --run "workspace kept=docs/bench/h200/prefill-workspace-keep.json" --out docs/bench/h200/prefill-lengths.png

Each --run is LABEL=FILE; every run of a file with two or more prompt lengths becomes one line (its
cache size appended to the label where a file holds several): tok/s against prompt tokens, and with
--target N,TOK_S,... the goals as points."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plot_runs import labelled_runs, new_axes, save_axes  # noqa: E402


def lines(spec: str) -> list[tuple[str, list[int], list[float]]]:
    """[(label, prompt lengths, tok/s)] of every run of LABEL=FILE that timed two or more lengths."""
    label, runs = labelled_runs(spec, "plot_prefill")
    found = [r for r in runs if len(r.get("prefill", [])) >= 2]
    if not found:
        raise SystemExit(f"plot_prefill: {spec.partition('=')[2]}: no run timed two or more prompt lengths "
                         "(bench --prefill-tokens)")
    out = []
    for run in found:
        points = sorted((p["tokens"], p["tok_s"]) for p in run["prefill"])
        name = label if len(found) == 1 else f"{label}, {run['cache_size']}"
        out.append((name, [n for n, _ in points], [t for _, t in points]))
    return out


def targets(text: str | None) -> list[tuple[int, float]]:
    """--target 512,10000,2048,20000 -> [(512, 10000.0), (2048, 20000.0)]."""
    if not text:
        return []
    values = text.split(",")
    try:
        if len(values) % 2:
            raise ValueError
        return [(int(values[i]), float(values[i + 1])) for i in range(0, len(values), 2)]
    except ValueError:
        raise SystemExit(f"plot_prefill: --target {text!r}: expected TOKENS,TOK_S pairs") from None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="LABEL=FILE.json (bench --prefill-tokens output)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--target", default=None, metavar="TOKENS,TOK_S,...", help="goals to mark, as pairs")
    p.add_argument("--title", default="Prefill speed by prompt length")
    args = p.parse_args(argv)
    goals = targets(args.target)
    fig, ax = new_axes()
    for spec in args.run:
        for name, lengths, tok_s in lines(spec):
            ax.plot(lengths, tok_s, marker="o", label=name)
    if goals:
        ax.scatter([n for n, _ in goals], [t for _, t in goals], marker="_", s=400, color="black", label="goal")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("prefill tok/s")
    ax.set_xscale("log", base=2)
    save_axes(fig, ax, args.out, args.title, legend=dict(loc="lower right", fontsize=8))


if __name__ == "__main__":
    main()
