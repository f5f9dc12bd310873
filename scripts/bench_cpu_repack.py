"""How long the CPU share's up-front repack takes (moestream/layers/cpu_share.py: every host-tier
record into torch's int4 CPU layout, once), per expert, for a number of repack threads; JSON out.

    python scripts/bench_cpu_repack.py --workers 1 2 4 8 16 --out docs/bench/cpu_repack.json

Synthetic 4-bit records of the Qwen3-30B-A3B expert shape (hidden 2048, intermediate 768, group
64) are repacked by `CpuShare.repack_host_tier` itself (each thread one record at a time on one
intra-op thread); for comparison, one thread repacking with torch's intra-op threads. The figure
is wall time / records; a model's whole host tier takes records x that (6,144 for the 30B)."""
from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch

from moestream.format.records import RecordField
from moestream.layers.cpu_share import CpuShare
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")
NAMES = {torch.int32: "U32", torch.bfloat16: "BF16"}


class Records:
    """A stand-in for the expert cache: `count` records of one layer, held in RAM."""

    def __init__(self, hidden: int, inter: int, group: int, count: int):
        self.fields, parts, offset = [], [], 0
        for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                                   "down_proj": (hidden, inter)}.items():
            w, s, b = quantize(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02, 4, group)
            for part, t in (("weight", w.view(torch.int32)), ("scales", s), ("biases", b)):
                self.fields.append(RecordField(f"{proj}.{part}", NAMES[t.dtype], list(t.shape), offset, t.nbytes))
                parts.append(t.contiguous().view(torch.uint8).reshape(-1))
                offset += t.nbytes
        one = torch.cat(parts)
        self.records = [one.clone() for _ in range(count)]  # distinct buffers: each read comes from RAM
        self.record_bytes = one.numel()

    def record_fields(self, layer):
        return self.fields

    def quant(self, layer):
        return {p: QuantSpec(4, 64) for p in PROJS}

    def host_view(self, layer, expert):
        return self.records[expert], None


def repack_all(records: Records, *, workers: int, dtype: torch.dtype) -> float:
    share = CpuShare(records, [0], share=1.0, dtype=dtype)
    t0 = time.perf_counter()
    share.repack_host_tier([(0, e) for e in range(len(records.records))], workers=workers)
    seconds = time.perf_counter() - t0
    assert share.st.repacks == len(records.records)
    share.close()
    return seconds / len(records.records)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--records", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3, help="each setting this many times, interleaved; the median")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    records = Records(2048, 768, 64, args.records)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    settings = [("pool", w) for w in args.workers] + [("intra-op", cores)]
    times: dict = {s: [] for s in settings}
    repack_all(records, workers=1, dtype=dtype)  # warm-up
    for _ in range(args.rounds):
        for kind, n in settings:
            if kind == "pool":
                times[(kind, n)].append(repack_all(records, workers=n, dtype=dtype))
            else:  # one thread, torch's own intra-op threads
                torch.set_num_threads(n)
                times[(kind, n)].append(repack_all(records, workers=1, dtype=dtype))
                torch.set_num_threads(1)
    one = sorted(times[("pool", 1)])[len(times[("pool", 1)]) // 2] if ("pool", 1) in times else None
    results = []
    for (kind, n), ts in times.items():
        median = sorted(ts)[len(ts) // 2]
        row = {"way": "threads, one record each" if kind == "pool" else "one thread, torch intra-op threads",
               "threads": n, "ms_per_expert": round(median * 1e3, 2), "all_ms": [round(t * 1e3, 2) for t in ts],
               "speedup_vs_1": round(one / median, 2) if one else None}
        results.append(row)
        print(json.dumps(row))
    out = {"what": "up-front repack of 4-bit Qwen3-30B-A3B expert records into torch's int4 CPU layout, ms per expert",
           "record_bytes": records.record_bytes, "records": args.records, "dtype": args.dtype,
           "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cores": cores,
           "load_1min_before": round(os.getloadavg()[0], 2),
           "command": "python scripts/bench_cpu_repack.py --workers " + " ".join(map(str, args.workers))
           + f" --records {args.records} --rounds {args.rounds} --dtype {args.dtype}",
           "results": results}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
