"""Fitting the lookahead's per-layer correction on text (`moestream fit-lookahead`): record each MoE
layer's expert input and chosen experts over text, fit a map per (later layer, depth)
(moestream.experts.guess_maps), and measure its guesses against the plain router and against
reusing the previous token's experts."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from moestream.errors import MoestreamError
from moestream.experts.guess_maps import GuessMaps, choose_and_fit, manifest_digest, overlap, top_k
from moestream.layers.moe import MoEBlock

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
    """Guess accuracy per target layer at `depth` (the share of its experts a guess names, over tokens
    with a previous token): `router` (its router on the source's expert input), `fitted` (with the
    map, where there is one), `previous_token` (its experts of the token before)."""
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


@dataclass
class FitResult:
    maps: GuessMaps
    report: dict  # "depthD": mean accuracies ("router", "fitted", "previous_token") and "per_layer"
    fit_files: int
    check_files: int
    fit_tokens: int
    check_tokens: int


def fit_lookahead(engine, texts: list[list[int]], *, check_share: float = 0.25, rank: int = 0) -> FitResult:
    """Fit maps on the first (1 - check_share) of `texts` and measure their guesses on the rest.
    Needs at least 2 texts and 2 MoE layers (a MoestreamError says which is missing)."""
    blocks = moe_blocks(engine.model)
    depths = tuple(d for d in (1, 2) if len(blocks) > d)
    if len(texts) < 2:
        raise MoestreamError("the text gives fewer than 2 files of at least 64 tokens")
    if not depths:
        raise MoestreamError("the model has fewer than 2 MoE layers: there is nothing to guess ahead")
    cut = min(len(texts) - 1, max(1, round(len(texts) * (1 - check_share))))
    with torch.inference_mode():
        fit_cap, check_cap = capture(engine, texts[:cut]), capture(engine, texts[cut:])
    maps = fit_maps(fit_cap, blocks, depths=depths, rank=rank)
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
    return FitResult(maps, report, fit_files=cut, check_files=len(texts) - cut, fit_tokens=fit_cap.rows,
                     check_tokens=check_cap.rows)
