"""What the plotting scripts share: LABEL=FILE arguments (a label and the runs of a `moestream bench`
JSON), an axes to draw on and its saving as a PNG."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from moestream.bench.plots import pyplot, save_png


def labelled_runs(spec: str, tool: str) -> tuple[str, list[dict]]:
    """(label, runs) of `spec` = LABEL=FILE.json; SystemExit with one line naming `tool` and the problem."""
    label, sep, path = spec.partition("=")
    if not sep:
        raise SystemExit(f"{tool}: --run {spec!r}: expected LABEL=FILE")
    try:
        return label, json.loads(Path(path).read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{tool}: {path}: not a bench JSON with runs ({exc})")


def new_axes():
    """(figure, axes) of the plots' size."""
    return pyplot().subplots(figsize=(7, 4.5))


def save_axes(fig, ax, out: str, title: str, legend: dict | None = None) -> None:
    """Title, grid and legend on `ax`, then `fig` written to `out` (PNG) and one line saying so."""
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(**(legend or {}))
    save_png(fig, out)
    print(f"wrote {out}", file=sys.stderr)
