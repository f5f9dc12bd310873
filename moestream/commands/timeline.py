"""`moestream timeline TRACE.json`: summarize a `--timeline` trace: time per kind of work, and the
compute device's idle time by cause (moestream.bench.timeline_summary)."""
from __future__ import annotations

import json
from pathlib import Path

from moestream.bench.timeline_summary import TraceError, render, summarize
from moestream.commands.args import Parser, fail


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="moestream timeline", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", help="a --timeline trace (Chrome trace JSON)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = p.parse_args(argv)
    try:
        summary = summarize(json.loads(Path(args.trace).read_text()))
    except OSError as exc:
        return fail("moestream timeline", f"{args.trace}: cannot read ({exc.strerror})")
    except (ValueError, UnicodeDecodeError) as exc:  # TraceError is a ValueError, as is bad JSON
        reason = exc if isinstance(exc, TraceError) else "not JSON"
        return fail("moestream timeline", f"{args.trace}: {reason}")
    print(json.dumps(summary, indent=1) if args.json else render(summary))
    return 0

