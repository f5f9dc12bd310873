"""Time paged attention (moestream.kernels.triton_paged_attention) against torch SDPA on contiguous
K/V, at the attention shapes of Gemma-4-26B-A4B, gpt-oss-20b and Qwen3-30B-A3B; JSON out.

    python scripts/bench_paged_attention.py --out paged-attention.json [--contexts 512 4096 32768]
        [--rows 1] [--prefill 512 2048] [--block-size 16] [--dtype bf16] [--min-chunk 64] [--max-splits 64]

Decode: --rows rows (batch 1 by default) of one sequence at the last position of a --contexts long
cache, with the kernel's split rule for the shape, or each rule of --min-chunk x --max-splits (a
sweep when several; us_paged is the fastest, us_paged_by_split all of them); prefill: --prefill
rows at positions 0..n-1 of one sequence (the chunk's K/V already in the cache). Each cell is the median over replays of a CUDA
graph of several calls, each call on its own copy of the cache (at least 200 MB of copies, so K/V
come from HBM as in a step where the other layers pass between two calls), in microseconds per
call. SDPA gets the same keys contiguous ([1, Nkv, n, D], enable_gqa; a window as the last
`window` keys in decode and as a boolean mask in prefill) and computes no sinks (gpt-oss): its
cells there are a bound, not the same work.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moestream.bench.machine import machine_info  # noqa: E402
from moestream.kernels import triton_paged_attention as pa  # noqa: E402

DEVICE = "cuda"
# (model, layer kind): (Nq, Nkv, D, window, sinks)
SHAPES = {
    ("gemma-4-26b-a4b", "sliding"): (16, 8, 256, 1024, False),
    ("gemma-4-26b-a4b", "full"): (16, 2, 512, None, False),
    ("gpt-oss-20b", "sliding"): (64, 8, 64, 128, True),
    ("gpt-oss-20b", "full"): (64, 8, 64, None, True),
    ("qwen3-30b-a3b", "full"): (32, 4, 128, None, False),
}
FLUSH_BYTES = 200 << 20  # cache copies timed in turn: at least this many bytes (an H200's L2 is 50 MB)
MAX_COPIES = 32
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def paged_pool(n: int, Nkv: int, D: int, BS: int, dtype, g):
    """One sequence of n positions in shuffled blocks: (k_cache, v_cache, block_table [1, MB])."""
    blocks = -(-n // BS)
    table = torch.randperm(blocks, generator=g).to(torch.int32).view(1, blocks)
    k = torch.randn(blocks, BS, Nkv, D, generator=g).to(dtype)
    v = torch.randn(blocks, BS, Nkv, D, generator=g).to(dtype)
    return k.to(DEVICE), v.to(DEVICE), table.to(DEVICE)


def contiguous(cache, table, n: int):
    """[1, Nkv, n, D] keys of positions 0..n-1 from a paged cache."""
    BS = cache.shape[1]
    idx = torch.arange(n, device=DEVICE)
    return cache[table[0].long()[idx // BS], idx % BS].permute(1, 0, 2).unsqueeze(0).contiguous()


def time_graph(calls, reps: int) -> float:
    """Median µs per call of a CUDA graph running `calls` (a list of thunks) once each."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # compiled and warm before the capture
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return round(statistics.median(times), 2)


def cell(model: str, layer: str, kind: str, rows: int, context: int, args) -> dict:
    Nq, Nkv, D, window, sinks = SHAPES[(model, layer)]
    dtype = DTYPES[args.dtype]
    g = torch.Generator().manual_seed(0)
    kv_bytes = 2 * context * Nkv * D * dtype.itemsize
    copies = max(1, min(MAX_COPIES, -(-FLUSH_BYTES // kv_bytes)))
    pools = [paged_pool(context, Nkv, D, args.block_size, dtype, g) for _ in range(copies)]
    q = torch.randn(rows, Nq, D, generator=g).to(dtype).to(DEVICE)
    if kind == "decode":
        positions = torch.full((rows,), context - 1, device=DEVICE)
    else:
        positions = torch.arange(context, device=DEVICE)
    seq = torch.zeros(rows, dtype=torch.int32, device=DEVICE)
    opts = {"scale": D ** -0.5, "window": window,
            "sinks": torch.randn(Nq, generator=g).to(DEVICE) if sinks else None}
    attend = pa.paged_attention if kind == "decode" else pa.paged_prefill
    block_n = pa.decode_tile(dtype, Nq // Nkv, D, D).block_n  # a split rule's min_chunk is a multiple of it
    rule = pa.decode_split_rule(dtype, D, D)
    splits = [{"min_chunk": c, "max_splits": n} for c in args.min_chunk or [rule[0]]
              for n in args.max_splits or [rule[1]] if c % block_n == 0] if kind == "decode" else [{}]
    ours = {}
    for split in splits:
        timed = time_graph([lambda k=k, v=v, t=t: attend(q, k, v, t, positions, seq, **opts, **split)
                            for k, v, t in pools], args.reps)
        ours["default" if not split else f"min_chunk={split['min_chunk']},max_splits={split['max_splits']}"] = timed

    # SDPA over the same keys, contiguous
    qs = q.permute(1, 0, 2).unsqueeze(0)  # [1, Nq, rows, D]
    mask = None
    dense = []
    for k, v, t in pools:
        kc, vc = contiguous(k, t, context), contiguous(v, t, context)
        if kind == "decode" and window is not None:
            kc, vc = kc[:, :, -window:], vc[:, :, -window:]
        dense.append((kc, vc))
    if kind == "prefill" and window is not None:
        i = torch.arange(context, device=DEVICE)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - window)

    def sdpa(kc, vc):
        return F.scaled_dot_product_attention(qs, kc, vc, attn_mask=mask, is_causal=kind == "prefill" and mask is None,
                                              scale=opts["scale"], enable_gqa=True)

    theirs = time_graph([lambda kc=kc, vc=vc: sdpa(kc, vc) for kc, vc in dense], args.reps)
    out = attend(q, *pools[0], positions, seq, **opts)
    ref = sdpa(*dense[0]).squeeze(0).permute(1, 0, 2).reshape(rows, -1)
    diff = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
    return {"kind": kind, "model": model, "layer": layer, "Nq": Nq, "Nkv": Nkv, "D": D, "window": window,
            "sinks": sinks, "rows": rows, "context": context, "block_size": args.block_size, "dtype": args.dtype,
            "cache_copies": copies, "us_paged": min(ours.values()), "us_paged_by_split": ours, "us_sdpa": theirs,
            "rel_diff_vs_sdpa": None if sinks else float(f"{diff:.3g}")}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 4096, 32768])
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="decode rows per call (batch 1: one)")
    p.add_argument("--prefill", type=int, nargs="*", default=[512, 2048], help="prefill chunk lengths")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    p.add_argument("--reps", type=int, default=50)
    p.add_argument("--min-chunk", type=int, nargs="+",
                   help="decode split rules to time (a sweep: several values; default: the kernel's rule)")
    p.add_argument("--max-splits", type=int, nargs="+")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    if args.block_size < 1 or args.reps < 1 or min(args.contexts + args.rows + args.prefill, default=1) < 1:
        p.error("--block-size, --reps, --contexts, --rows and --prefill take positive numbers")
    for Nq, Nkv, D, window, sinks in SHAPES.values():
        block_n = pa.decode_tile(DTYPES[args.dtype], Nq // Nkv, D, D).block_n
        if args.rows and args.min_chunk and not any(c % block_n == 0 for c in args.min_chunk):
            p.error(f"--min-chunk: none is a multiple of {block_n} (the decode kernel's keys per step at D {D})")
    cells = []
    for model, layer in SHAPES:
        runs = [("decode", rows, ctx) for rows in args.rows for ctx in args.contexts]
        runs += [("prefill", n, n) for n in args.prefill]
        for kind, rows, ctx in runs:
            cells.append(cell(model, layer, kind, rows, ctx, args))
            print(json.dumps(cells[-1]), flush=True)
    out = {"what": "paged attention (Triton) against SDPA on contiguous K/V, µs per call in a CUDA graph",
           **machine_info(), "cells": cells}
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
