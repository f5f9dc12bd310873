"""`moestream heatmap REPORT.json OUT.png`: the expert cache's hit rate per MoE layer as a heatmap
(moestream.bench.heatmap draws it)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from moestream.bench.heatmap import ReportError, plot_heatmap
from moestream.commands.args import Parser, check_output_paths, fail


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream heatmap", description="Plot the expert hit rate per layer of a receipt or bench JSON.")
    p.add_argument("report", help="a receipt (generate --receipt) or a bench JSON (bench --out)")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--title", default=None, help="the plot's title")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_paths(parser, args, {"out": "OUT"})
    prog = "moestream heatmap"
    try:
        report = json.loads(Path(args.report).read_text())
    except OSError as exc:
        return fail(prog, f"{args.report}: cannot read ({exc.strerror})")
    except (ValueError, UnicodeDecodeError):
        return fail(prog, f"{args.report}: not JSON (give a receipt or a bench JSON)")
    try:
        if not isinstance(report, dict):
            raise ReportError("not a receipt or a bench JSON (not a JSON object)")
        plot_heatmap(report, args.out, title=args.title)
    except ReportError as exc:
        return fail(prog, f"{args.report}: {exc}")
    print(f"wrote {args.out}")
    return 0

