"""`moestream <sub> ...`: a thin dispatcher to each subcommand's module `main(argv)`."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS = {
    "convert": ("moestream.convert.main", "pack a Hugging Face checkpoint (folder or Hub repo) into a moestream model"),
    "pull": ("moestream.convert.pull", "download a Hub repo and pack it shard by shard (extra disk: the largest shard)"),
    "verify": ("moestream.format.verify", "check a packed model's files and expert records against its manifest"),
    "generate": ("moestream.engine.cli", "generate text with a packed model, streaming experts from disk"),
    "serve": ("moestream.server.main", "OpenAI-compatible HTTP server"),
    "bench": ("moestream.bench.main", "benchmark prefill/decode speed, hit rate and read bandwidth"),
    "ab": ("moestream.bench.ab", "A B B A runs of two commands: ratio B/A, 95 % CI, A-A noise floor"),
    "synth": ("moestream.bench.synth", "write a packed model with random weights in a real model's shapes"),
    "fit-lookahead": ("moestream.engine.fit_lookahead", "fit the lookahead's per-layer guess correction on text"),
    "simulate": ("moestream.sim.main", "replay routing traces through cache policies"),
    "heatmap": ("moestream.bench.heatmap", "plot the expert hit rate per layer of a receipt or bench JSON"),
}


def usage() -> str:
    lines = ["usage: moestream <command> [options]   (moestream <command> --help for each)", "", "commands:"]
    for name, (module, text) in COMMANDS.items():
        if importlib.util.find_spec(module) is not None:
            lines.append(f"  {name:<13} {text}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS or importlib.util.find_spec(COMMANDS[name][0]) is None:
        print(f"moestream: unknown command {name!r}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
