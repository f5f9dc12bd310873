"""`moestream convert SRC OUT`: pack a Hugging Face checkpoint (folder, .gguf file or Hub repo) into a packed model."""
from __future__ import annotations

import argparse
import logging
import os

from moestream.commands.args import Parser, run_resumable
from moestream.convert.main import GROUP_SIZES, QUANT_BITS, convert
from moestream.flag_values import at_least


def add_packing_arguments(p: argparse.ArgumentParser, job: str) -> None:
    """The flags convert and pull share: quantization, resume, force, progress."""
    p.add_argument("--quant", choices=list(QUANT_BITS), default=None,
                   help="expert and matrix quantization (default q4; an MXFP4 source's experts keep MXFP4)")
    p.add_argument("--group-size", type=int, choices=GROUP_SIZES, default=64, help="quantization group size (default 64)")
    p.add_argument("--resume", action="store_true", help=f"continue an unfinished {job} into OUT")
    p.add_argument("--force", action="store_true", help="overwrite a non-empty OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-mtp", action="store_true",
                   help="leave out the checkpoint's multi-token-prediction layers (a smaller pack; no --speculative mtp)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream convert", description="Pack a Hugging Face MoE checkpoint into moestream's format.")
    p.add_argument("src", help="checkpoint folder (config.json + *.safetensors) or a Hub repo id")
    p.add_argument("out", help="output directory")
    add_packing_arguments(p, "conversion")
    p.add_argument("--revision", help="Hub revision (branch, tag or commit) when SRC is a repo id")
    p.add_argument("--tokenizer", help="for a .gguf SRC: a folder whose tokenizer files to copy")
    p.add_argument("--workers", type=at_least(1), default=min(os.cpu_count() or 1, 8),
                   help="threads building expert records, each running torch single-threaded (default: CPUs, at most 8)")
    # for tests of --resume: die abruptly inside expert layer N (not a user option, so not shown)
    p.add_argument("--kill-after-layers", type=int, default=None, help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.workers > 1:
        import torch

        torch.set_num_threads(1)  # parallel over experts: per-op thread teams only add barrier waits
    return run_resumable("moestream convert", lambda: convert(
        args.src, args.out, quant=args.quant, group_size=args.group_size, force=args.force, resume=args.resume,
        revision=args.revision, progress=not args.no_progress, workers=args.workers,
        kill_after_layers=args.kill_after_layers, tokenizer=args.tokenizer, mtp=not args.no_mtp), "wrote {}")
