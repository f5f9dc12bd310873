"""`moestream ab "CMD_A" "CMD_B"`: A B B A runs of two commands, the ratio B/A with its 95 % interval
and the A-A noise floor (moestream.bench.ab runs and analyses them)."""
from __future__ import annotations

import json
import logging
import os
import platform
import shlex
import sys
from dataclasses import asdict
from pathlib import Path

from moestream.bench.ab import ORDER, ABError, analyse, plot, run_rounds, verdict
from moestream.commands.args import Parser, check_output_paths, fail
from moestream.flag_values import at_least, non_negative_float


def build_parser() -> Parser:
    p = Parser(prog="moestream ab",
               description="Run two shell commands in A B B A order and say whether B differs from A by more "
                           "than the noise (ratio B/A, bootstrap 95 %% CI, A-A noise floor). Each run gives one "
                           "number: its stdout's last line, or --metric PATH of the JSON it writes to {out}. "
                           "{run} in a command is the run's index.")
    p.add_argument("command_a", metavar="CMD_A", help="the baseline, a shell command")
    p.add_argument("command_b", metavar="CMD_B", help="the candidate, a shell command")
    p.add_argument("--rounds", type=at_least(2), default=5, help="rounds of A B B A (default 5, at least 2)")
    p.add_argument("--metric", default=None,
                   help="a dotted path (decode.tok_s, runs.-1.decode.tok_s) into the JSON each command writes to "
                        "{out} (a temporary file path put into the command)")
    p.add_argument("--warmup", type=at_least(0), default=0, help="runs of A and B first, discarded (default 0)")
    p.add_argument("--timeout", type=non_negative_float, default=None, help="seconds one run may take")
    p.add_argument("--seed", type=at_least(0), default=0, help="the bootstrap's seed (default 0)")
    p.add_argument("--out", default=None, help="write the runs and the result as JSON")
    p.add_argument("--plot", default=None, help="write a PNG of the runs and the ratio with its interval")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_paths(parser, args, {"out": "--out", "plot": "--plot"})
    if args.metric is not None:
        missing = [label for label, cmd in (("CMD_A", args.command_a), ("CMD_B", args.command_b)) if "{out}" not in cmd]
        if missing:
            parser.error(f"argument --metric: {' and '.join(missing)} must write its JSON to {{out}}")
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        runs = run_rounds(args.command_a, args.command_b, rounds=args.rounds, metric=args.metric,
                          warmup=args.warmup, timeout=args.timeout or None)
    except ABError as exc:
        return fail("moestream ab", str(exc))
    result = analyse(runs, seed=args.seed)
    report = {"command_a": args.command_a, "command_b": args.command_b, "metric": args.metric,
              "rounds": args.rounds, "order": "".join(ORDER), "warmup": args.warmup, "result": result,
              "runs": [asdict(r) for r in runs],
              "machine": {"platform": platform.platform(), "python": platform.python_version(),
                          "cpu_count": os.cpu_count(),
                          "command": shlex.join(["moestream", "ab", *(sys.argv[1:] if argv is None else argv)])}}
    print(verdict(result))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    if args.plot:
        plot(report, args.plot)
    return 0
