"""`moestream fit-lookahead MODEL [OUT]`: fit the lookahead's per-layer correction on text.

Runs the model over text (teacher-forced prefill, every expert resident), records each MoE layer's
expert input and chosen experts, fits a map per (later layer, depth) that turns one layer's expert
input into a better guess of a later layer's router logits (moestream.experts.guess_maps), and
writes them to OUT (default MODEL/lookahead.safetensors, where the engine finds them). The text's
files are split: the maps are fitted on the first part and their guess accuracy is measured on the
rest, against the plain router and against reusing the previous token's experts.

    moestream fit-lookahead path/to/packed                 # text: the Python standard library
    moestream fit-lookahead path/to/packed out.safetensors --text corpus/ --tokens 32768 --rank 16
"""
from __future__ import annotations

import argparse
import json
import logging
import sysconfig
from pathlib import Path

from moestream.commands.args import Parser, fail
from moestream.engine.fit_lookahead import fit_lookahead, text_files, token_texts
from moestream.errors import MoestreamError
from moestream.experts.guess_maps import FILE_NAME
from moestream.flag_values import at_least

PROG = "moestream fit-lookahead"
DEFAULT_FILE_TOKENS = 1024


def share_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    p = Parser(prog=PROG, description=__doc__)
    p.add_argument("model", help="packed model directory")
    p.add_argument("out", nargs="?", help=f"maps file to write (default MODEL/{FILE_NAME}, where the engine finds it)")
    p.add_argument("--text", nargs="+", default=None, metavar="PATH",
                   help="text files or directories (*.py, *.txt, *.md, *.rst); default: the Python standard library")
    p.add_argument("--tokens", type=at_least(256), default=16384, help="tokens of text in all (default 16384)")
    p.add_argument("--file-tokens", type=at_least(64), default=None,
                   help=f"tokens from each file's start (default {DEFAULT_FILE_TOKENS}, or the model's context if shorter)")
    p.add_argument("--check-share", type=share_arg, default=0.25,
                   help="share of the files kept out of the fit to measure the guesses on (default 0.25)")
    p.add_argument("--rank", type=at_least(0), default=0, help="rank of each correction (default 0: full, min(E, H))")
    p.add_argument("--device", default="cpu", help="where the model runs while recording (default cpu)")
    p.add_argument("--json", action="store_true", help="print the accuracy table as JSON")
    args = p.parse_args(argv)
    if not (Path(args.model) / "moestream.json").is_file():
        p.error(f"argument MODEL: {args.model} is not a packed model (no moestream.json)")
    out = Path(args.out) if args.out else Path(args.model) / FILE_NAME
    if not out.parent.is_dir():
        p.error(f"argument OUT: the folder {out.parent} does not exist")
    if out.is_dir():
        p.error(f"argument OUT: {out} is a folder, not a file")
    try:
        files = text_files(args.text or [sysconfig.get_paths()["stdlib"]])
    except FileNotFoundError as exc:
        p.error(f"argument --text: {exc.args[0].removeprefix('--text ')}")
    try:
        engine = Engine.load(args.model, options=EngineOptions(device=args.device, cache_size="all",
                                                               prefill_chunk_tokens=args.file_tokens or 1024,
                                                               lookahead_maps="none"), prefetch=False)
    except MoestreamError as exc:
        return fail(PROG, str(exc))
    try:
        per_file = args.file_tokens or min(DEFAULT_FILE_TOKENS, engine.max_context)
        if per_file > engine.max_context:  # each file's tokens are one prefill from an empty cache
            p.error(f"argument --file-tokens: {per_file} tokens do not fit the model's context of "
                    f"{engine.max_context} tokens")
        # each file is encoded whole, then cut to per_file tokens: the tokenizer's note that a file is
        # longer than the model's context is not news
        logging.getLogger("transformers").setLevel(logging.ERROR)
        texts = token_texts(engine.tokenizer, files, tokens=args.tokens, per_file=per_file)
        fit = fit_lookahead(engine, texts, check_share=args.check_share, rank=args.rank)
        fit.maps.save(out)
    except MoestreamError as exc:
        return fail(PROG, str(exc))
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"out": str(out), "maps": len(fit.maps.maps), "bytes": fit.maps.nbytes,
                          "accuracy": fit.report}, indent=1))
        return 0
    print(f"fitted on {fit.fit_tokens} tokens ({fit.fit_files} files), checked on {fit.check_tokens} tokens "
          f"({fit.check_files} files)")
    for d, r in fit.report.items():
        print(f"{d}: guess accuracy router {r['router']:.3f}  fitted {r['fitted']:.3f}  "
              f"previous token {r['previous_token']:.3f}")
    print(f"wrote {out} ({len(fit.maps.maps)} maps, {fit.maps.nbytes} bytes)")
    return 0
