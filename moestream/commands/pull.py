"""`moestream pull REPO OUT`: download a Hub checkpoint and pack it shard by shard."""
from __future__ import annotations

import argparse
import logging

from moestream.commands.args import Parser, run_resumable
from moestream.commands.convert import add_packing_arguments
from moestream.convert.pull import _gib, plan_pull, pull


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream pull",
               description="Download a Hub MoE checkpoint and pack it shard by shard (extra disk: the largest shard).")
    p.add_argument("repo", help="Hub repo id (owner/name)")
    p.add_argument("out", help="output directory")
    p.add_argument("--revision", help="branch, tag or commit (default main)")
    add_packing_arguments(p, "pull")
    p.add_argument("--dry-run", action="store_true", help="print the files, their size and the packed size; download no weights")
    # for tests of --resume: die abruptly half-way through the (N+1)-th shard (not a user option)
    p.add_argument("--kill-after-shards", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.quant = args.quant or "q4"  # pull streams float and MLX checkpoints only: no MXFP4 experts to keep
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    if args.dry_run:
        return run_resumable("moestream pull", lambda: dry_run(args), "{}")
    return run_resumable("moestream pull", lambda: pull(
        args.repo, args.out, revision=args.revision, quant=args.quant, group_size=args.group_size, force=args.force,
        resume=args.resume, progress=not args.no_progress, kill_after_shards=args.kill_after_shards,
        mtp=not args.no_mtp),
        "wrote {} (verified)")


def dry_run(args) -> str:
    """What a pull would download and write, as text (nothing is downloaded but headers)."""
    repo, sizes = plan_pull(args.repo, revision=args.revision, quant=args.quant, group_size=args.group_size)
    lines = [f"{args.repo}@{repo.commit}: would download {len(sizes.downloads)} files, "
             f"{_gib(sum(sizes.downloads.values()))}:"]
    lines += [f"  {name:<48} {_gib(size):>12}" for name, size in sizes.downloads.items()]
    lines.append(f"packed size ({args.quant}): {_gib(sizes.packed_bytes)} (plus the manifest); "
                 f"extra disk while pulling: {_gib(sizes.largest_shard)} (the largest shard)")
    return "\n".join(lines)
