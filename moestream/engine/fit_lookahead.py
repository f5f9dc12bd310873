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
from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestream.commands.args import fail
from moestream.experts.guess_maps import FILE_NAME, GuessMaps, choose_and_fit, manifest_digest, overlap, top_k
from moestream.layers.moe import MoEBlock

log = logging.getLogger(__name__)
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst")


@dataclass
class Capture:
    """Per MoE layer, every token's expert input and chosen experts, texts one after another."""

    hn: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, H] float32
    ids: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [N, k] int64
    starts: list[int] = field(default_factory=list)  # row where each text begins

    @property
    def rows(self) -> int:
        return next(iter(self.ids.values())).shape[0] if self.ids else 0

    def first_rows(self) -> torch.Tensor:
        """[N] bool: the first token of a text (it has no previous token)."""
        mask = torch.zeros(self.rows, dtype=torch.bool)
        mask[self.starts] = True
        return mask


def moe_blocks(model) -> list[MoEBlock]:
    return [layer.ffn for layer in model.layers if isinstance(layer.ffn, MoEBlock)]


def capture(engine, texts: list[list[int]]) -> Capture:
    """Prefill each token list from an empty KV cache and record what each MoE layer's router saw
    and chose (the experts' input hn and the top-k ids)."""
    blocks = moe_blocks(engine.model)
    got: dict[int, tuple[list, list]] = {b.layer: ([], []) for b in blocks}
    for b in blocks:
        def route(x, b=b, route=b.route):
            weights, ids = route(x)
            got[b.layer][0].append(x.detach().float().cpu())
            got[b.layer][1].append(ids.detach().cpu())
            return weights, ids
        b.route = route  # an instance attribute: deleting it brings back the method
    out = Capture()
    try:
        row = 0
        for ids in texts:
            out.starts.append(row)
            engine.reset()
            engine.prefill(ids)
            row += len(ids)
    finally:
        for b in blocks:
            del b.route
    for layer, (hn, ids) in got.items():
        out.hn[layer], out.ids[layer] = torch.cat(hn), torch.cat(ids).long()
    return out


def fit_maps(cap: Capture, blocks: list[MoEBlock], *, depths=(1, 2), rank: int = 0) -> GuessMaps:
    """A map for every (MoE layer l+d, depth d) from layer l's expert input."""
    maps = {}
    for d in depths:
        for src, tgt in zip(blocks, blocks[d:]):
            x = cap.hn[src.layer]
            with torch.no_grad():
                target = tgt.router_logits(cap.hn[tgt.layer].to(tgt.router.dtype)).float()
            maps[(tgt.layer, d)] = choose_and_fit(x, target, cap.ids[tgt.layer], tgt.router, tgt.router_bias,
                                                  rank=rank)
    return GuessMaps(maps, {"depths": list(depths), "rank": rank})


def evaluate(cap: Capture, blocks: list[MoEBlock], *, depth: int, maps: GuessMaps | None = None) -> dict:
    """Guess accuracy per target layer at `depth` (share of the layer's k experts the guess names,
    mean over tokens that have a previous token): `router` (the target's router on the source's
    expert input), `fitted` (with the map, where `maps` has one), `previous_token` (the target
    layer's experts of the token before)."""
    keep = ~cap.first_rows()
    out = {}
    for src, tgt in zip(blocks, blocks[depth:]):
        x, actual = cap.hn[src.layer], cap.ids[tgt.layer]
        k = actual.shape[1]
        prev = torch.roll(actual, 1, dims=0)
        with torch.no_grad():
            row = {"source_layer": src.layer,
                   "router": float(overlap(top_k(tgt.router_logits(x.to(tgt.router.dtype)), k), actual)[keep].mean()),
                   "previous_token": float(overlap(prev, actual)[keep].mean())}
            if maps is not None and maps.get(tgt.layer, depth) is not None:
                row["fitted"] = float(overlap(top_k(maps.logits(tgt, depth, x), k), actual)[keep].mean())
        out[tgt.layer] = row
    return out


def mean_of(per_layer: dict, key: str) -> float | None:
    vals = [r[key] for r in per_layer.values() if key in r]
    return round(sum(vals) / len(vals), 4) if vals else None


def text_files(paths: list[str]) -> list[Path]:
    """Files under `paths` (files as given, directories searched for text files), sorted per directory."""
    files = []
    for p in map(Path, paths):
        if p.is_dir():
            files += sorted(f for f in p.rglob("*") if f.suffix in TEXT_SUFFIXES and f.is_file()
                            and "site-packages" not in f.parts and "__pycache__" not in f.parts)
        elif p.is_file():
            files.append(p)
        else:
            raise FileNotFoundError(f"--text {p}: no such file or directory")
    return files


def token_texts(tokenizer, files: list[Path], *, tokens: int, per_file: int, min_tokens: int = 64) -> list[list[int]]:
    """Up to `per_file` tokens from the start of each file, until `tokens` in all."""
    texts, total = [], 0
    for f in files:
        if total >= tokens:
            break
        try:
            ids = tokenizer.encode(f.read_text(encoding="utf-8"), add_special_tokens=False)[:min(per_file, tokens - total)]
        except (UnicodeDecodeError, OSError):
            continue
        if len(ids) >= min_tokens:
            texts.append(ids)
            total += len(ids)
    return texts


def share_arg(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1, not {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    from moestream.commands.args import Parser, at_least
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
