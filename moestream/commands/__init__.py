"""`moestream <sub> ...`: a thin dispatcher to each subcommand's module `main(argv)`."""
from __future__ import annotations

import importlib
import os
import sys

# subcommand -> (module, one-line help)
COMMANDS = {
    "convert": ("moestream.commands.convert", "pack a Hugging Face checkpoint (folder or Hub repo) into a moestream model"),
    "pull": ("moestream.commands.pull", "download a Hub repo and pack it shard by shard (extra disk: the largest shard)"),
    "verify": ("moestream.commands.verify", "check a packed model's files and expert records against its manifest"),
    "generate": ("moestream.commands.generate", "generate text with a packed model, streaming experts from disk"),
    "serve": ("moestream.commands.serve", "OpenAI-compatible HTTP server"),
    "bench": ("moestream.commands.bench", "benchmark prefill/decode speed, hit rate and read bandwidth"),
    "ab": ("moestream.commands.ab", "A B B A runs of two commands: ratio B/A, 95 % CI, A-A noise floor"),
    "synth": ("moestream.commands.synth", "write a packed model with random weights in a real model's shapes"),
    "fit-lookahead": ("moestream.commands.fit_lookahead", "fit the lookahead's per-layer guess correction on text"),
    "simulate": ("moestream.commands.simulate", "replay routing traces through cache policies"),
    "heatmap": ("moestream.commands.heatmap", "plot the expert hit rate per layer of a receipt or bench JSON"),
    "timeline": ("moestream.commands.timeline", "summarize a --timeline trace: time per kind of work, idle time by cause"),
}


def usage() -> str:
    lines = ["usage: moestream <command> [options]   (moestream <command> --help for each; moestream --version)", "",
             "commands:"]
    for name, (module, text) in COMMANDS.items():
        lines.append(f"  {name:<13} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. A reader that goes away (`moestream generate --help | head`) ends the run
    quietly, exit 141 (128 + SIGPIPE) as a shell would report it; Ctrl+C one line, exit 130; neither
    a traceback."""
    try:
        try:
            return dispatch(list(sys.argv[1:] if argv is None else argv))
        finally:  # here, not at exit, where a failed flush is a traceback-like note and exit 120
            sys.stdout.flush()
    except KeyboardInterrupt:  # Ctrl+C: each command has already stopped what it started
        print("moestream: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # what is left in stdout's buffer cannot be written either: point it at /dev/null so the
        # flush at exit does not fail a second time
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 141


def dispatch(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from moestream import __version__

        print(f"moestream {__version__}")
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"moestream: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)

