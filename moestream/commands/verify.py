"""`moestream verify MODEL`: check a packed model's files (sha256) and expert records (layout, crc32)."""
from __future__ import annotations

import sys

from moestream.commands.args import Parser, fail
from moestream.errors import MoestreamError
from moestream.format.verify import verify


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="moestream verify",
               description="Check a packed model's files (sha256) and expert records (layout, crc32).")
    p.add_argument("model", help="packed model directory")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    try:
        report = verify(args.model, progress=not args.no_progress)
    except MoestreamError as exc:
        return fail("moestream verify", str(exc))
    except OSError as exc:
        return fail("moestream verify", f"{exc.filename or args.model}: {exc.strerror or exc}")
    if not report.ok:
        for problem in report.problems:
            print(f"moestream verify: error: {problem}", file=sys.stderr)
        print(f"moestream verify: {args.model}: {len(report.problems)} problem(s) found", file=sys.stderr)
        return 1
    print(f"{args.model}: OK, {report.files} files ({report.bytes / 2**30:.2f} GiB) match their sha256; "
          f"{report.records} expert records in {report.layers} layer{'s' if report.layers != 1 else ''} pass their crc32 "
          "and layout checks")
    return 0
