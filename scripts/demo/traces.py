"""Routing traces of the demo model on held-out text, and what a cache would make of them.

    record  run the packed demo model over the first --tokens tokens of --files files of the test
            split (never trained on), one token per forward (prefill_chunk_tokens=1, as decode asks
            for experts), with moestream's routing trace on (EngineOptions(trace_routing=...));
            one compressed .npz per file in --out, plus record.json (command, files, machine,
            the engine's own expert hit rate at its default cache)
    report  replay the traces through the cache simulator (moestream.sim, the engine's own slot
            directory and policies) at each size and policy; print mean hit rates next to two
            baselines, and each layer's expert usage

The files: the test-split files (corpus order, as in test.npy) with more than --tokens tokens,
--files of them evenly spaced through that list; each trace covers tokens 0..tokens-1 of its file.
Teacher-forced on real text: the routing is that of the model reading the file, not of its own
generations.

    python scripts/demo/traces.py record --out data/traces
    python scripts/demo/traces.py report data/traces/*.npz
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def pick_files(corpus: dict, *, count: int, tokens: int) -> list[dict]:
    """Test files with more than `tokens` tokens, `count` of them evenly spaced, with their offset in test.npy."""
    offset, eligible = 0, []
    for f in corpus["files"]:
        if f["split"] != "test":
            continue
        if f["tokens"] > tokens:  # its count includes the closing <|endoftext|>
            eligible.append({**f, "offset": offset})
        offset += f["tokens"]
    if len(eligible) < count:
        raise SystemExit(f"only {len(eligible)} test files have more than {tokens} tokens")
    return [eligible[i * len(eligible) // count] for i in range(count)]


def trace_name(index: int, path: str) -> str:
    return f"demo-test-{index:02d}-{path.removesuffix('.py').replace('/', '_')}.npz"


def cmd_record(args: argparse.Namespace) -> int:
    import torch

    from moestream.bench.machine import machine_info
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0], ROOT)] + sys.argv[1:])
    data = Path(args.data)
    corpus = json.loads((data / "corpus.json").read_text())
    test = np.load(data / "test.npy")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for i, f in enumerate(pick_files(corpus, count=args.files, tokens=args.tokens)):
        end = f["offset"] + f["tokens"]
        if test[end - 1] != 0:
            raise SystemExit(f"{f['path']}: test.npy does not match corpus.json (no <|endoftext|> at {end - 1})")
        ids = test[f["offset"]:f["offset"] + args.tokens].astype(np.int64).tolist()
        path = out / trace_name(i, f["path"])
        engine = Engine.load(args.model, options=EngineOptions(device=args.device, cache_size=args.cache_size,
                                                               prefill_chunk_tokens=1, trace_routing=str(path)))
        engine.trace.meta.update({
            "text": f"CPython {corpus['python']} stdlib, test split: {f['path']} (sha256 {f['sha256'][:12]}), "
                    f"tokens 0..{args.tokens - 1} of {f['tokens'] - 1}",
            "tokens": args.tokens, "mode": "teacher-forced, one token per forward (prefill_chunk_tokens=1)"})
        t0 = time.perf_counter()
        engine.prefill(ids)
        seconds = time.perf_counter() - t0
        stats = engine.expert_stats()
        engine.close()  # writes the trace
        runs.append({"trace": path.name, "file": f["path"], "file_sha256": f["sha256"], "file_tokens": f["tokens"],
                     "tokens": args.tokens, "bytes": path.stat().st_size, "seconds": round(seconds, 1),
                     "engine_cache": {"slots": stats["slots"], "policy": stats["policy"], "hits": stats["hits"],
                                      "misses": stats["misses"], "hit_rate": stats["hit_rate"]}})
        print(f"{path}: {f['path']}, {args.tokens} tokens in {seconds:.0f} s, engine hit rate "
              f"{stats['hit_rate']:.3f} ({stats['slots']} slots, {stats['policy']})", flush=True)
    record = {"command": command, "model": engine.model_name,
              "model_manifest_sha256": _sha256(engine.packed.directory / "moestream.json"),
              "data": {"corpus": corpus["corpus"], "python": corpus["python"], "split": "test",
                       "test_sha256": corpus["splits"]["test"]["sha256"]},
              "traces": runs, "machine": {k: v for k, v in machine_info().items() if k != "command"}}
    (out / "record.json").write_text(json.dumps(record, indent=1) + "\n")
    return 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ----------------------------------------------------------------------------- report


def uniform_like(trace, seed: int):
    """The same rows (layer, position) with each row's experts drawn uniformly, without repeats."""
    from moestream.experts.trace import RoutingTrace

    rng = np.random.default_rng(seed)
    n, k = trace.experts.shape
    experts = np.argsort(rng.random((n, trace.meta["num_experts"])), axis=1)[:, :k].astype(np.int16)
    return RoutingTrace(trace.layer, trace.position, experts, trace.meta)


def static_best(trace, slots: int) -> float:
    """Hit rate of a cache that holds the trace's `slots` most used (layer, expert) pairs all along
    (knowing the whole trace in advance; cold misses ignored)."""
    keys = trace.layer.astype(np.int64)[:, None] * trace.meta["num_experts"] + trace.experts
    counts = np.sort(np.bincount(keys.ravel()))[::-1]
    return float(counts[:slots].sum() / counts.sum())


def layer_usage(traces) -> list[dict]:
    """Per MoE layer over all traces: how unevenly the experts are chosen, and how often a token
    reuses an expert the previous token chose in that layer."""
    num_experts, top_k = traces[0].meta["num_experts"], traces[0].experts.shape[1]
    out = []
    for layer in traces[0].meta["moe_layers"]:
        counts = np.zeros(num_experts)
        reused = total = 0
        for t in traces:
            rows = t.experts[t.layer == layer]  # [T, A], token order
            counts += np.bincount(rows.ravel(), minlength=num_experts)
            prev = np.zeros((len(rows), num_experts), bool)
            prev[np.arange(1, len(rows))[:, None], rows[:-1]] = True
            reused += int(prev[np.arange(len(rows))[:, None], rows][1:].sum())
            total += rows[1:].size
        share = counts / counts.sum()
        nz = share[share > 0]
        top = np.sort(share)[::-1]
        out.append({"layer": int(layer),
                    "normalized_entropy": round(float(-(nz * np.log(nz)).sum() / math.log(num_experts)), 3),
                    "max_share_over_uniform": round(float(top[0] * num_experts), 2),
                    "top_quarter_share": round(float(top[:num_experts // 4].sum()), 3),
                    "experts_under_1pct": int((share < 0.01).sum()),
                    "reuse_from_previous_token": round(reused / total, 3),
                    "reuse_if_independent": round(_reuse_independent(share, top_k), 3)})
    return out


def _reuse_independent(share: np.ndarray, top_k: int) -> float:
    """Chance that one of a token's experts was among the previous token's, if tokens chose
    independently with these marginal shares (each expert is in a row with probability top_k*share)."""
    p = np.clip(share * top_k, 0, 1)
    return float((p * p).sum() / top_k)


def cmd_report(args: argparse.Namespace) -> int:
    from moestream.commands.simulate import parse_sizes
    from moestream.sim.simulate import simulate, total_experts
    from moestream.experts.trace import RoutingTrace

    traces = [RoutingTrace.load(p) for p in args.traces]
    policies = args.policies.split(",")
    total = total_experts(traces[0])
    floor = traces[0].experts.shape[1]
    sizes = parse_sizes(args.sizes, total, floor)
    rows = []
    for label, slots in sizes:
        row = {"size": label, "slots": slots, "uniform_share": round(slots / total, 4)}
        for policy in policies:
            rates = [simulate(t, slots=slots, policy=policy).hit_rate for t in traces]
            row[policy] = {"mean": round(float(np.mean(rates)), 4), "min": round(min(rates), 4), "max": round(max(rates), 4)}
        uniform = [simulate(uniform_like(t, seed=i), slots=slots, policy=policies[0]).hit_rate for i, t in enumerate(traces)]
        row[f"uniform_routing_{policies[0]}"] = round(float(np.mean(uniform)), 4)
        row["static_best"] = round(float(np.mean([static_best(t, slots) for t in traces])), 4)
        rows.append(row)
    layers = layer_usage(traces)
    result = {"traces": [str(p) for p in args.traces], "rows_per_trace": [len(t) for t in traces],
              "total_experts": total, "hit_rates": rows, "layers": layers}
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    print(f"{len(traces)} traces, {sum(len(t) for t in traces)} (token, layer) rows, {total} experts\n")
    head = ["size", "slots"] + [p.upper() for p in policies] + [f"uniform routing ({policies[0].upper()})", "static best"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for r in rows:
        cells = [r["size"], str(r["slots"])]
        cells += [f"{r[p]['mean']:.3f} ({r[p]['min']:.3f}–{r[p]['max']:.3f})" for p in policies]
        cells += [f"{r[f'uniform_routing_{policies[0]}']:.3f}", f"{r['static_best']:.3f}"]
        print("| " + " | ".join(cells) + " |")
    print()
    head = ["layer", "normalized entropy", "busiest / uniform", "top 25 % of experts' share", "experts < 1 %",
            "reuse from previous token", "reuse if independent"]
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---:" for _ in head) + "|")
    for l in layers:
        print(f"| {l['layer']} | {l['normalized_entropy']:.3f} | {l['max_share_over_uniform']:.2f} "
              f"| {l['top_quarter_share']:.3f} "
              f"| {l['experts_under_1pct']} | {l['reuse_from_previous_token']:.3f} | {l['reuse_if_independent']:.3f} |")
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="run the model on held-out files with routing traces on")
    r.add_argument("--model", help="packed model directory (default: the built-in demo model)")
    r.add_argument("--data", default=str(ROOT / "build" / "demo-data"), help="prepared data folder (corpus.json, test.npy)")
    r.add_argument("--files", type=int, default=8)
    r.add_argument("--tokens", type=int, default=1024, help="tokens per file, from its start (default 1024)")
    r.add_argument("--out", default=str(ROOT / "data" / "traces"))
    r.add_argument("--device", default="cpu")
    r.add_argument("--cache-size", default="auto", help="the engine's cache while recording (routing does not depend on it)")
    r.add_argument("--threads", type=int, default=1)
    s = sub.add_parser("report", help="simulated hit rates and per-layer expert usage of traces")
    s.add_argument("traces", nargs="+")
    s.add_argument("--sizes", default="10%,25%,50%")
    s.add_argument("--policies", default="clock,lru,arc,lfu")
    s.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    return {"record": cmd_record, "report": cmd_report}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
