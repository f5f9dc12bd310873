"""`moestream heatmap REPORT.json OUT.png`: the expert cache's hit rate per MoE layer as a heatmap.

REPORT is a receipt (`generate --receipt`, one row) or a bench JSON (`bench --out`, one row per
cache size); both carry the cache's `hit_rate_per_layer` (since the engine loaded). Layers run
along x, rows are runs; a layer with no lookups is left blank."""
from __future__ import annotations

import math
from pathlib import Path

from moestream.bench.plots import pyplot, save_png


class ReportError(ValueError):
    pass


def hit_rate_rows(report: dict) -> tuple[list[str], list[int], list[list[float]]]:
    """(row labels, MoE layers, hit rates [row][layer], NaN where a layer had no lookups)."""
    if isinstance(report.get("runs"), list):  # bench JSON
        rows = [(f"cache {run.get('cache_size', '?')}", run.get("experts") or {}) for run in report["runs"]]
    elif isinstance(report.get("experts"), dict):  # receipt
        rows = [(f"receipt ({report.get('model') or 'model'})", report["experts"])]
    else:
        raise ReportError("not a receipt or a bench JSON (no experts or runs)")
    per_row = [(label, stats.get("hit_rate_per_layer")) for label, stats in rows]
    if not per_row or any(not isinstance(p, dict) for _, p in per_row):
        raise ReportError("has no hit_rate_per_layer (an older receipt, or a run without streamed experts)")
    layers = sorted({int(layer) for _, p in per_row for layer in p})
    if not layers:
        raise ReportError("hit_rate_per_layer is empty (no expert was looked up)")
    matrix = [[float(p[str(layer)]) if str(layer) in p else math.nan for layer in layers] for _, p in per_row]
    return [label for label, _ in per_row], layers, matrix


def plot_heatmap(report: dict, path: str | Path, *, title: str | None = None) -> None:
    import numpy as np

    labels, layers, matrix = hit_rate_rows(report)
    data = np.ma.masked_invalid(np.array(matrix, dtype=float))
    fig, ax = pyplot().subplots(figsize=(min(16, 2.5 + 0.22 * len(layers)), 1.4 + 0.35 * len(labels)))
    image = ax.imshow(data, aspect="auto", cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    step = max(1, len(layers) // 24)
    ax.set_xticks(range(0, len(layers), step), [str(layers[i]) for i in range(0, len(layers), step)], fontsize=7)
    ax.set_xlabel("MoE layer")
    fig.colorbar(image, ax=ax, label="expert hit rate", fraction=0.04)
    if len(layers) * len(labels) <= 64:  # small: print the numbers too
        for r, row in enumerate(matrix):
            for c, value in enumerate(row):
                if not math.isnan(value):
                    ax.text(c, r, f"{value:.2f}", ha="center", va="center", fontsize=6,
                            color="black" if value > 0.6 else "white")
    ax.set_title(title or "expert cache hit rate per layer", fontsize=9)
    save_png(fig, path)
