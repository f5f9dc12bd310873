"""How fast the CPU share's native kernels compute a job of one token (moestream/cpu_share/kernels.py),
in GB/s of expert record bytes, on N threads; JSON out.

    python scripts/bench_cpu_experts.py --threads 16 --out docs/bench/cpu_experts_kernels.json

Jobs of --jobs experts (1, 2, 4 and 8), one call each, on the records as they are, with float32
activations and, where the CPU has AVX-512 VNNI, int8 ones (`int8_over_float`: the int8 path's GB/s
over the float one's); dequantize-then-matmul in torch beside them, the arithmetic they replace.

The shape defaults to Qwen3-30B-A3B's expert (hidden 2048, intermediate 768, group 64). Each timed
call uses the next of --experts distinct experts (more bytes than the last-level cache holds), so
weights come from RAM as they do when decoding."""
from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import torch

from moestream.cpu_share import kernels as native
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


def job_row(module, recs, quant, bits: int, threads: int, n: int, hidden: int) -> dict:
    """A CPU-share job of n experts for one token on the native kernels, GB/s of records."""
    nbytes = record_bytes(recs[0])
    row = {"bits": bits, "threads": threads, "experts_per_job": n, "job_bytes": n * nbytes}
    blobs, fields = zip(*(native.record_blob(r) for r in recs))
    addresses = torch.tensor([b.data_ptr() for b in blobs], dtype=torch.int64)
    ones, zeros, picks = torch.ones(n), torch.zeros(n, dtype=torch.int32), torch.arange(n, dtype=torch.int32)
    x, out = torch.randn(1, hidden), torch.empty(n, hidden)
    for acts in ("float", "int8") if native.vnni() else ("float",):
        layout = native.layout(fields[0], quant, int8_activations=acts == "int8")

        def native_job(i):
            start = (i * n) % (len(blobs) - n + 1)
            module.weighted_rows(layout, addresses[start:start + n], picks, zeros, ones, x, out, threads)

        s = timed(native_job, max(8, 4 * len(recs) // n))
        row[f"native_{acts}_us"], row[f"native_{acts}_gb_s"] = round(s * 1e6, 1), round(n * nbytes / s / 1e9, 3)
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
    ap.add_argument("--jobs", type=int, nargs="+", default=[1, 2, 4, 8], help="experts per CPU-share job")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    module = native.load()
    if module is None:
        raise SystemExit(f"no native kernels: {native.reason()}")
    results, jobs = [], []
    for bits in (4, 8):
        quant = {p: QuantSpec(bits, args.group) for p in PROJS}
        recs = [record(args.hidden, args.inter, bits, args.group) for _ in range(args.experts)]
        nbytes = record_bytes(recs[0])
        for threads in args.threads:
            torch.set_num_threads(threads)
            x = torch.randn(1, args.hidden, dtype=torch.bfloat16)
            s = timed(lambda i: expert_ffn(x, recs[i % len(recs)], quant), 8)
            row = {"bits": bits, "threads": threads, "record_bytes": nbytes,
                   "dequantize_then_matmul_us": round(s * 1e6, 1),
                   "dequantize_then_matmul_gb_s": round(nbytes / s / 1e9, 3)}
            results.append(row)
            print(json.dumps(row))
            for n in args.jobs:
                job = job_row(module, recs, quant, bits, threads, n, args.hidden)
                jobs.append(job)
                print(json.dumps(job))
    out = {"what": "CPU-share jobs of one token on the native kernels, GB/s of record bytes",
           "shape": {"hidden": args.hidden, "inter": args.inter, "group": args.group},
           "experts_cycled": args.experts, "torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
           "command": "python scripts/bench_cpu_experts.py " + " ".join(
               f"--{k} {' '.join(map(str, v))}" if isinstance(v, list) else f"--{k} {v}"
               for k, v in vars(args).items() if v is not None and k != "out"),
           "results": results, "jobs": jobs, "native_vnni": native.vnni(),
           "native_activations_default": native.activations()}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
