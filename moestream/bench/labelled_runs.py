"""LABEL=FILE arguments of the plotting scripts: a label and the runs of a `moestream bench` JSON."""
from __future__ import annotations

import json
from pathlib import Path


def labelled_runs(spec: str, tool: str) -> tuple[str, list[dict]]:
    """(label, runs) of `spec` = LABEL=FILE.json; SystemExit with one line naming `tool` and the problem."""
    label, sep, path = spec.partition("=")
    if not sep:
        raise SystemExit(f"{tool}: --run {spec!r}: expected LABEL=FILE")
    try:
        return label, json.loads(Path(path).read_text())["runs"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SystemExit(f"{tool}: {path}: not a bench JSON with runs ({exc})")
