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
import sysconfig
from pathlib import Path

import torch

from moestream.commands.args import Parser, at_least, fail
from moestream.engine.fit_lookahead import capture, evaluate, fit_maps, mean_of, moe_blocks, text_files, token_texts
from moestream.experts.guess_maps import FILE_NAME, manifest_digest


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
    from moestream.errors import MoestreamError

    p = Parser(prog="moestream fit-lookahead", description=__doc__,
               formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="packed model directory")
    p.add_argument("out", nargs="?", help=f"maps file to write (default MODEL/{FILE_NAME}, where the engine finds it)")
    p.add_argument("--text", nargs="+", default=None, metavar="PATH",
                   help="text files or directories (*.py, *.txt, *.md, *.rst); default: the Python standard library")
    p.add_argument("--tokens", type=at_least(256), default=16384, help="tokens of text in all (default 16384)")
    p.add_argument("--file-tokens", type=at_least(64), default=1024, help="tokens from each file's start (default 1024)")
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
    try:
        files = text_files(args.text or [sysconfig.get_paths()["stdlib"]])
    except FileNotFoundError as exc:
        p.error(f"argument --text: {exc.args[0].removeprefix('--text ')}")
    try:
        engine = Engine.load(args.model, options=EngineOptions(device=args.device, cache_size="all",
                                                               prefill_chunk_tokens=args.file_tokens,
                                                               prefetch="none", lookahead_maps="none"))
    except MoestreamError as exc:
        return fail("moestream fit-lookahead", str(exc))
    try:
        texts = token_texts(engine.tokenizer, files, tokens=args.tokens, per_file=args.file_tokens)
        blocks = moe_blocks(engine.model)
        depths = tuple(d for d in (1, 2) if len(blocks) > d)
        problem = ("the text gives fewer than 2 files of at least 64 tokens" if len(texts) < 2 else
                   "the model has fewer than 2 MoE layers: there is nothing to guess ahead" if not depths else None)
        if problem:
            return fail("moestream fit-lookahead", problem)
        cut = min(len(texts) - 1, max(1, round(len(texts) * (1 - args.check_share))))
        with torch.inference_mode():
            fit_cap, check_cap = capture(engine, texts[:cut]), capture(engine, texts[cut:])
        maps = fit_maps(fit_cap, blocks, depths=depths, rank=args.rank)
        maps.meta.update({"model_manifest_sha256": manifest_digest(engine.packed.directory),
                          "fit_tokens": fit_cap.rows, "check_tokens": check_cap.rows})
        report = {}
        for d in depths:
            per_layer = evaluate(check_cap, blocks, depth=d, maps=maps)
            report[f"depth{d}"] = {"router": mean_of(per_layer, "router"), "fitted": mean_of(per_layer, "fitted"),
                                   "previous_token": mean_of(per_layer, "previous_token"),
                                   "per_layer": {str(k): {n: round(v, 4) for n, v in r.items()}
                                                 for k, r in per_layer.items()}}
        maps.meta["check_accuracy"] = {k: {n: v for n, v in r.items() if n != "per_layer"} for k, r in report.items()}
        maps.save(out)
    finally:
        engine.close()
    if args.json:
        print(json.dumps({"out": str(out), "maps": len(maps.maps), "bytes": maps.nbytes, "accuracy": report}, indent=1))
        return 0
    print(f"fitted on {fit_cap.rows} tokens ({cut} files), checked on {check_cap.rows} tokens ({len(texts) - cut} files)")
    for d, r in report.items():
        print(f"{d}: guess accuracy router {r['router']:.3f}  fitted {r['fitted']:.3f}  "
              f"previous token {r['previous_token']:.3f}")
    print(f"wrote {out} ({len(maps.maps)} maps, {maps.nbytes} bytes)")
    return 0
