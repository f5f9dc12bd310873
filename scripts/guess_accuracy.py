"""Lookahead guess accuracy per MoE layer on real routing (the demo model), with and without a
fitted per-layer correction.

The lookahead guesses MoE layer l+d's experts from layer l's expert input hn_l (depth d = 1, 2).
For each target layer this measures, on held-out text, the share of the layer's k experts that a
guess names:

  router          top-k(router_{l+d}(hn_l)): what the lookahead guesses today
  fitted          top-k(router_{l+d}(hn_l) + u (v hn_l) + c): the fitted logit correction
                  (moestream.experts.guess_maps, full rank min(E, H)), and at --ranks r
  hidden map      top-k(router_{l+d}(W hn_l + b)): a ridge map from hn_l to hn_{l+d} [H, H]
  previous token  the experts layer l+d chose for the token before (temporal reuse)

Text: the demo corpus (CPython 3.11.7 stdlib, scripts/demo/corpus.py), test split only (never
trained on). Evaluated on the 8 files the committed routing traces cover (data/traces/record.json,
first 1024 tokens each; the captured routing is compared with those traces); the corrections
are fitted on other test-split files (first 1024 tokens each, --fit-tokens in all).

    OMP_NUM_THREADS=2 python scripts/guess_accuracy.py --out docs/bench/guess-accuracy-demo.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts" / "demo"))

METHODS = ("router", "fitted", "hidden_map", "previous_token")


def corpus_texts(tokenizer, *, fit_tokens: int, per_file: int):
    """(eval texts, their names, fit texts, their names): see the module docstring."""
    import corpus

    record = json.loads((ROOT / "data" / "traces" / "record.json").read_text())
    traced = [r["file"] for r in record["traces"]]
    files, _ = corpus.list_corpus(corpus.stdlib_dir())
    by_path = {f.path: f for f in files}
    missing = [p for p in traced if p not in by_path]
    if missing:
        raise SystemExit(f"the traced files are not in this Python's stdlib: {missing}")
    for r in record["traces"]:
        if by_path[r["file"]].sha256 != r["file_sha256"]:
            raise SystemExit(f"{r['file']}: not the file the traces were recorded on (sha256 differs)")
    enc = lambda f: tokenizer.encode(f.text, add_special_tokens=False)  # noqa: E731 (as test.npy: no specials)
    evals = [enc(by_path[p])[:per_file] for p in traced]
    fit, fit_names, total = [], [], 0
    for f in files:
        if f.split != "test" or f.path in traced or total >= fit_tokens:
            continue
        ids = enc(f)[:min(per_file, fit_tokens - total)]
        if len(ids) >= 128:
            fit.append(ids)
            fit_names.append(f.path)
            total += len(ids)
    return evals, traced, fit, fit_names


def trace_agreement(cap, names) -> float:
    """Share of (token, layer) rows whose top-k set equals the committed trace's."""
    from moestream.experts.trace import RoutingTrace

    record = json.loads((ROOT / "data" / "traces" / "record.json").read_text())
    same = total = 0
    ends = cap.starts[1:] + [cap.rows]
    for r, start, end in zip(record["traces"], cap.starts, ends):
        trace = RoutingTrace.load(ROOT / "data" / "traces" / r["trace"])
        for layer, ids in cap.ids.items():
            ours = np.sort(ids[start:end].numpy(), axis=1)
            theirs = np.sort(trace.experts[trace.layer == layer][:end - start].astype(np.int64), axis=1)
            same += int((ours == theirs).all(axis=1).sum())
            total += len(ours)
    return same / total


def hidden_map_accuracy(fit, ev, blocks, depth: int, alpha: float) -> dict:
    """Ridge map hn_l -> hn_{l+d} ([H, H] + bias, pulled toward identity), then the router."""
    from moestream.experts.guess_maps import overlap, top_k

    out = {}
    keep = ~ev.first_rows()
    for src, tgt in zip(blocks, blocks[depth:]):
        x, y = fit.hn[src.layer].double(), fit.hn[tgt.layer].double()
        xm, ym = x.mean(0), y.mean(0)
        xc, yc = x - xm, y - ym
        gram = xc.T @ xc
        lam = alpha * float(torch.diagonal(gram).mean())
        eye = torch.eye(gram.shape[0], dtype=gram.dtype)
        w = torch.linalg.solve(gram + lam * eye, xc.T @ yc + lam * eye).T  # regularized toward W = I
        b = ym - w @ xm
        guess = (ev.hn[src.layer].double() @ w.T + b).float()
        k = ev.ids[tgt.layer].shape[1]
        acc = overlap(top_k(tgt.router_logits(guess), k), ev.ids[tgt.layer])[keep].mean()
        out[tgt.layer] = float(acc)
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    styles = {"router": ("router on this layer's input", "C0", "o"), "fitted": ("+ fitted correction", "C2", "s"),
              "hidden_map": ("ridge map to the later input, then router", "C1", "^"),
              "previous_token": ("previous token's experts", "C7", "x")}
    for ax, d in zip(axes, ("depth1", "depth2")):
        per = result["accuracy"][d]["per_layer"]
        layers = [int(k) for k in per]
        for m, (label, color, marker) in styles.items():
            ax.plot(layers, [per[str(l)][m] for l in layers], marker=marker, color=color, label=label)
        ax.axhline(result["chance"], color="k", lw=0.8, ls=":", label=f"chance (k/E = {result['chance']:.3f})")
        ax.set_title(f"guess {d[-1]} MoE layer{'s' if d[-1] == '2' else ''} ahead")
        ax.set_xlabel("target MoE layer")
        ax.set_xticks(layers)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share of the layer's top-4 experts guessed")
    axes[0].set_ylim(0, 1)
    axes[1].legend(loc="lower right", fontsize=8)
    fig.suptitle("Lookahead guess accuracy, demo model, held-out stdlib files (8 x 1024 tokens)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from moestream.bench.machine import machine_info
    from moestream.engine.engine import Engine
    from moestream.engine.fit_lookahead import capture, evaluate, fit_maps, mean_of, moe_blocks
    from moestream.engine.options import EngineOptions

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fit-tokens", type=int, default=16384)
    p.add_argument("--file-tokens", type=int, default=1024)
    p.add_argument("--ranks", default="4,8,16", help="low ranks of the fitted correction to measure too")
    p.add_argument("--hidden-alpha", type=float, default=0.1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=str(ROOT / "docs" / "bench" / "guess-accuracy-demo.json"))
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    t0 = time.perf_counter()
    engine = Engine.load(options=EngineOptions(device="cpu", cache_size="all", prefill_chunk_tokens=args.file_tokens,
                                               prefetch="none", lookahead_maps="none"))
    evals, eval_names, fits, fit_names = corpus_texts(engine.tokenizer, fit_tokens=args.fit_tokens,
                                                      per_file=args.file_tokens)
    blocks = moe_blocks(engine.model)
    with torch.inference_mode():
        ev, fit = capture(engine, evals), capture(engine, fits)
    engine.close()
    agreement = trace_agreement(ev, eval_names)
    maps = fit_maps(fit, blocks, depths=(1, 2))
    ranked = {r: fit_maps(fit, blocks, depths=(1, 2), rank=r) for r in map(int, args.ranks.split(","))}
    E, k, H = blocks[0].num_experts, blocks[0].top_k, ev.hn[blocks[0].layer].shape[1]
    result = {"command": command, "machine": {k_: v for k_, v in machine_info().items() if k_ != "command"},
              "model": "moestream-demo (moestream/demo/model: Qwen3-MoE, 8 MoE layers x 32 experts, top-4, H 256)",
              "text": {"eval": {"files": eval_names, "tokens": ev.rows,
                                "what": "the 8 test-split stdlib files of data/traces/, first 1024 tokens each"},
                       "fit": {"files": len(fit_names), "tokens": fit.rows,
                               "what": "other test-split stdlib files (never trained on), first 1024 tokens each"}},
              "how": "teacher-forced prefill (chunks of --file-tokens), float32 CPU, every expert resident; "
                     "accuracy = share of the target layer's top-k experts the guess names, over tokens with a "
                     "previous token (the first token of each file left out)",
              "routing_matches_committed_traces": round(agreement, 4),
              "chance": k / E, "accuracy": {}, "rank_sweep": {},
              "bytes": {"fitted_full_rank_per_map": next(iter(maps.maps.values())).nbytes,
                        "fitted_full_rank_all": maps.nbytes, "maps": len(maps.maps),
                        "hidden_map_per_map": (H * H + H) * 4,
                        "router_per_layer": E * H * 4}}
    for d in (1, 2):
        per = evaluate(ev, blocks, depth=d, maps=maps)
        hidden = hidden_map_accuracy(fit, ev, blocks, d, args.hidden_alpha)
        for layer, row in per.items():
            row["hidden_map"] = hidden[layer]
            row["alpha"] = maps.get(layer, d).alpha
        result["accuracy"][f"depth{d}"] = {
            "mean": {m: mean_of(per, m) for m in METHODS},
            "per_layer": {str(layer): {n: (round(v, 4) if isinstance(v, float) else v) for n, v in row.items()}
                          for layer, row in per.items()}}
        for r, rm in ranked.items():
            result["rank_sweep"].setdefault(f"depth{d}", {})[f"rank{r}"] = {
                "mean_fitted": mean_of(evaluate(ev, blocks, depth=d, maps=rm), "fitted"), "bytes_all": rm.nbytes}
    result["seconds"] = round(time.perf_counter() - t0, 1)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, out.with_suffix(".png"))
    print(f"routing matches the committed traces on {agreement:.4f} of (token, layer) rows")
    for d in ("depth1", "depth2"):
        m = result["accuracy"][d]["mean"]
        print(f"{d}: " + "  ".join(f"{name} {m[name]:.3f}" for name in METHODS))
        for layer, row in result["accuracy"][d]["per_layer"].items():
            print(f"  layer {layer}: " + "  ".join(f"{name} {row[name]:.3f}" for name in METHODS))
    print(json.dumps(result["rank_sweep"]))
    print(f"wrote {out} and {out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
