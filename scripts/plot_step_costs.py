#!/usr/bin/env python
"""Plot what a step of T tokens costs, from `moestream bench --step-tokens ...` JSON files.

    python scripts/plot_step_costs.py --run "row by row=docs/bench/h200/step-rows-off-resident.json" \
        --run "rows at once=docs/bench/h200/step-rows-auto-resident.json" --out docs/bench/h200/step-rows.png

Each --run is LABEL=FILE; every run of a file that has step costs becomes one line (its cache size
appended to the label where a file holds several), milliseconds per step against T, with the cost of
T one-token steps dashed for reference."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from plot_runs import labelled_runs, new_axes, save_axes  # noqa: E402


def lines(spec: str) -> list[tuple[str, list[int], list[float]]]:
    """[(label, T values, ms)] of every run with step costs in LABEL=FILE."""
    label, runs = labelled_runs(spec, "plot_step_costs")
    found = [r for r in runs if "step_cost" in r]
    if not found:
        raise SystemExit(f"plot_step_costs: {spec.partition('=')[2]}: no run has step costs (bench --step-tokens)")
    out = []
    for run in found:
        ms = run["step_cost"]["step_ms"]
        sizes = sorted(int(t) for t in ms)
        name = label if len(found) == 1 else f"{label}, {run['cache_size']}"
        out.append((name, sizes, [ms[str(t)] for t in sizes]))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, help="LABEL=FILE.json (bench --step-tokens output)")
    p.add_argument("--out", required=True, help="PNG to write")
    p.add_argument("--title", default="Cost of a step of T tokens")
    args = p.parse_args(argv)
    fig, ax = new_axes()
    for spec in args.run:
        for name, sizes, ms in lines(spec):
            (line,) = ax.plot(sizes, ms, marker="o", label=name)
            ax.plot(sizes, [ms[0] * t / sizes[0] for t in sizes], linestyle="--", color=line.get_color(), alpha=0.4)
    ax.set_xlabel("tokens in the step (T)")
    ax.set_ylabel("ms per step")
    ax.set_xscale("log", base=2)
    save_axes(fig, ax, args.out, args.title + " (dashed: T one-token steps)")


if __name__ == "__main__":
    main()
