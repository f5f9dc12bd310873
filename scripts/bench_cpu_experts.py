"""How fast the CPU computes one token through one routed expert (moestream/kernels/cpu_experts.py),
in GB/s of expert record bytes, for each way of computing it, on N threads; JSON out.

    python scripts/bench_cpu_experts.py --threads 16 --out docs/bench/cpu_experts_kernels.json

Then the CPU share's jobs (--jobs: 1, 2, 4 and 8 experts, one token): torch's kernel on the repacked
records one expert after another (the Python worker's way) beside the native kernels
(moestream/kernels/native_experts.py) on the records as they are, one call per job, same threads,
with float32 activations and, where the CPU has AVX-512 VNNI, int8 ones; `native_over_torch` is the
ratio of the float path's GB/s to torch's, `int8_over_float` that of the int8 path's to the float's.

The shape defaults to Qwen3-30B-A3B's expert (hidden 2048, intermediate 768, group 64). Each timed
call uses the next of --experts distinct experts (more bytes than the last-level cache holds), so
weights come from RAM as they do when decoding. Also: repacking one expert (paid once per expert,
then kept) and dequantize-then-matmul in torch, the path the int kernels replace."""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from moestream.kernels import native_experts
from moestream.kernels.cpu_experts import repack
from moestream.kernels.reference import expert_ffn
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")


def record(hidden: int, inter: int, bits: int, group: int) -> dict[str, torch.Tensor]:
    rec = {}
    for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
        w, s, b = quantize(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02, bits, group)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec


def record_bytes(rec: dict[str, torch.Tensor]) -> int:
    return sum(t.nbytes for t in rec.values())


def timed(fn, calls: int) -> float:
    """Seconds per call: the median of 5 rounds of `calls` calls (fn(i) uses expert i)."""
    for i in range(min(calls, 8)):
        fn(i)
    rounds = []
    for _ in range(5):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(i)
        rounds.append((time.perf_counter() - t0) / calls)
    return sorted(rounds)[2]


def job_row(recs, quant, bits: int, threads: int, n: int, hidden: int, dtype) -> dict:
    """A CPU-share job of n experts for one token: torch's kernel (repacked records, one expert after
    another into preallocated rows) and the native kernels (the records as they are), GB/s of records."""
    nbytes = record_bytes(recs[0])
    row = {"bits": bits, "threads": threads, "experts_per_job": n, "job_bytes": n * nbytes}
    method = "int4" if bits == 4 else "int4x2"
    packed = [repack(r, quant, dtype, int8_method="dequantized" if method == "int4" else method) for r in recs]
    x, out = torch.randn(1, hidden, dtype=dtype), torch.empty(n, hidden)

    def torch_job(i):
        for k in range(n):
            packed[(i * n + k) % len(packed)].weighted_row_into(x, out[k], 1.0)

    s = timed(torch_job, max(8, 4 * len(recs) // n))
    row["torch_us"], row["torch_gb_s"] = round(s * 1e6, 1), round(n * nbytes / s / 1e9, 3)
    module = native_experts.load()
    if module is None:
        return row
    blobs, fields = zip(*(native_experts.record_blob(r) for r in recs))
    addresses = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64)
    ones, zeros, picks = torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
    xf = x.float()
    for acts in ("float", "int8") if native_experts.vnni() else ("float",):
        layout = native_experts.layout(fields[0], quant, int8_activations=acts == "int8")

        def native_job(i):
            start = (i * n) % (len(blobs) - n + 1)
            module.weighted_rows(layout, addresses[start:start + n], picks, zeros, ones, xf, out, threads)

        s = timed(native_job, max(8, 4 * len(recs) // n))
        row[f"native_{acts}_us"], row[f"native_{acts}_gb_s"] = round(s * 1e6, 1), round(n * nbytes / s / 1e9, 3)
    row["native_over_torch"] = round(row["native_float_gb_s"] / row["torch_gb_s"], 2)
    if "native_int8_gb_s" in row:
        row["int8_over_float"] = round(row["native_int8_gb_s"] / row["native_float_gb_s"], 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--experts", type=int, default=48, help="distinct experts cycled through (default 48: ~130 MB at 4 bits)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--jobs", type=int, nargs="*", default=[1, 2, 4, 8], help="experts per CPU-share job (none: skip)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    results, jobs = [], []
    for bits in (4, 8):
        quant = {p: QuantSpec(bits, args.group) for p in PROJS}
        recs = [record(args.hidden, args.inter, bits, args.group) for _ in range(args.experts)]
        nbytes = record_bytes(recs[0])
        methods = ["int4"] if bits == 4 else ["dequantized", "int4x2"]
        for threads in args.threads:
            torch.set_num_threads(threads)
            x = torch.randn(1, args.hidden, dtype=dtype)
            row = {"bits": bits, "threads": threads, "record_bytes": nbytes}
            for method in methods:
                t0 = time.perf_counter()
                packed = [repack(r, quant, dtype, int8_method="dequantized" if method == "int4" else method) for r in recs]
                row[f"{method}_repack_ms"] = round((time.perf_counter() - t0) / len(recs) * 1e3, 3)
                row[f"{method}_repacked_bytes"] = packed[0].nbytes
                s = timed(lambda i: packed[i % len(packed)].ffn(x), 4 * len(packed))
                row[f"{method}_us"] = round(s * 1e6, 1)
                row[f"{method}_gb_s"] = round(nbytes / s / 1e9, 3)
            if bits == 8:  # the per-row-scale int8 kernel: no group scales, so an upper bound only
                w8 = [(torch.randint(-128, 127, (2 * args.inter, args.hidden), dtype=torch.int8),
                       torch.randint(-128, 127, (args.hidden, args.inter), dtype=torch.int8)) for _ in recs]
                sg, sd = torch.rand(2 * args.inter, dtype=dtype), torch.rand(args.hidden, dtype=dtype)

                def int8pack(i):
                    gu_w, d_w = w8[i % len(w8)]
                    gu = torch.ops.aten._weight_int8pack_mm(x, gu_w, sg)
                    return torch.ops.aten._weight_int8pack_mm(F.silu(gu[:, :args.inter]) * gu[:, args.inter:], d_w, sd)

                s = timed(int8pack, 4 * len(w8))
                row["int8pack_per_row_scales_bound_us"] = round(s * 1e6, 1)
                row["int8pack_per_row_scales_bound_gb_s"] = round(nbytes / s / 1e9, 3)
            s = timed(lambda i: expert_ffn(x, recs[i % len(recs)], quant), 8)
            row["dequantize_then_matmul_us"] = round(s * 1e6, 1)
            row["dequantize_then_matmul_gb_s"] = round(nbytes / s / 1e9, 3)
            results.append(row)
            print(json.dumps(row))
            for n in args.jobs:
                job = job_row(recs, quant, bits, threads, n, args.hidden, dtype)
                jobs.append(job)
                print(json.dumps(job))
    out = {"what": "one token through one routed expert on the CPU, GB/s of record bytes",
           "shape": {"hidden": args.hidden, "inter": args.inter, "group": args.group}, "dtype": args.dtype,
           "experts_cycled": args.experts, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
           "command": "python scripts/bench_cpu_experts.py " + " ".join(
               f"--threads {' '.join(map(str, args.threads))}" if k == "threads" else f"--{k} {v}"
               for k, v in vars(args).items() if v is not None and k != "out"),
           "results": results, "jobs": jobs,
           "native": "built" if native_experts.load() is not None else native_experts.reason(),
           "native_vnni": native_experts.vnni(), "native_activations_default": native_experts.activations()}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
