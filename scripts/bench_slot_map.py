"""What one device-map lookup costs on the GPU, per victim rule; JSON out.

    python scripts/bench_slot_map.py --out slot-map.json

The device-driven path runs one lookup per MoE layer inside each step's CUDA graph
(moestream.experts.device_map with the one-program Triton lookup). The cycle rule reads two more
arrays per slot than LRU (its layer, that layer's lookup count). Here a Qwen3-30B-A3B-shaped map
(48 layers of 128 experts, 8 a token, 4-byte records in device memory: the copies cost next to
nothing, the lookup is what is timed) at each --sizes share of the experts is driven through
--tokens tokens of uniform routing, 48 lookups a token captured in one graph; the cell is the
graph's median replay time per lookup."""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

import torch

from moestream.bench.machine import machine_info
from moestream.experts.device_map import POLICIES, DeviceMap


def time_cell(policy: str, share: float, args) -> dict:
    slots = int(share * args.layers * args.experts)
    # records of 4 bytes: the smallest the gather kernel moves (it copies 32-bit words)
    dm = DeviceMap.synthetic(range(args.layers), args.experts, slots, record_bytes=4, device="cuda", policy=policy)
    g = torch.Generator().manual_seed(0)
    ids = torch.stack([torch.randperm(args.experts, generator=g)[:args.picks] for _ in range(args.layers)]).cuda()
    ids = ids.view(args.layers, 1, args.picks)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(4):  # compiled, and the pool filled before the capture
            for layer in range(args.layers):
                dm.ensure(layer, ids[layer])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for layer in range(args.layers):
            dm.ensure(layer, ids[layer])
    times = []
    for _ in range(args.tokens):
        # new experts each token (uniform routing), drawn outside the graph
        ids.copy_(torch.argsort(torch.rand((args.layers, 1, args.experts), device="cuda"), dim=-1)[..., :args.picks])
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / args.layers)
    hits, misses = dm.totals()
    return {"policy": policy, "cache": share, "slots": slots, "us_per_lookup": round(statistics.median(times), 3),
            "hit_rate": round(hits / max(1, hits + misses), 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=float, nargs="+", default=[0.1, 0.25, 0.5])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--picks", type=int, default=8)
    p.add_argument("--tokens", type=int, default=200)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    cells = []
    for share in args.sizes:
        for policy in POLICIES:
            cells.append(time_cell(policy, share, args))
            print(json.dumps(cells[-1]), flush=True)
    out = {"what": "one device-map lookup (Triton) per victim rule, uniform routing, in a CUDA graph",
           **machine_info(), "cells": cells}
    args.out.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
