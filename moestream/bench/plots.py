"""PNG figures without a display; matplotlib is imported on first use (only plotting needs it)."""
from __future__ import annotations


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_png(fig, path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
