"""The native CPU-share worker's hand-over on the CPU (moestream/cpu_share/worker.py): how long a
job takes from its posted sequence number to the answer, beyond the kernels' own time; JSON out.

    PYTHONPATH=. python scripts/bench_native_share_handover.py --threads 15 --out docs/bench/h200/native-share-handover.json

The mailbox is plain tensors laid out as moestream.cpu_share.share's; the device's side is
played by this process's main thread (the native worker never takes the GIL), which writes each
request (ids, header, then the sequence number), spins until the answer, then waits --gap-us (a
layer's time on the device, so the worker stays in its busy poll as during a step). Each job is 8
pairs of one token of which --withheld are the CPU's, each its own 4-bit expert cycled through
--experts distinct records (from RAM). Per shape: the end-to-end median, the worker's own figures
(its kernel time and its time beyond the kernels, from its per-job ring) and hand-over =
end-to-end - kernels. Shapes: a small expert (hidden 256, intermediate 128: nearly all hand-over)
and Qwen3-30B-A3B's (2048, 768) with 1 and 2 experts."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from moestream.cpu_share import kernels as native
from moestream.cpu_share.worker import NativeWorker
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")
SHAPES = ((256, 128, 1), (2048, 768, 1), (2048, 768, 2))  # hidden, intermediate, experts per job


def record(hidden: int, inter: int, seed: int) -> dict[str, torch.Tensor]:
    g, rec = torch.Generator().manual_seed(seed), {}
    for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
        w, s, b = quantize(torch.randn(rows, cols, generator=g).bfloat16(), 4, 64)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec


def measure(hidden: int, inter: int, withheld: int, args) -> dict:
    blobs = [native.record_blob(record(hidden, inter, s)) for s in range(args.experts)]
    layouts = native.layout(blobs[0][1], {p: QuantSpec(4, 64) for p in PROJS}).view(1, -1)
    addresses = torch.tensor([[b.data_ptr() for b, _ in blobs]], dtype=torch.int64)
    box = SimpleNamespace(header=torch.zeros(5, dtype=torch.int64), x_in=torch.randn(16, hidden).bfloat16(),
                          ids_in=torch.zeros(64, dtype=torch.int32), w_in=torch.full((64,), 0.3),
                          mask_in=torch.zeros(64, dtype=torch.int8), rows_out=torch.zeros(64, hidden),
                          ack=torch.zeros(1, dtype=torch.int64))
    worker = NativeWorker(box, layouts, addresses, threads=args.threads, busy_s=0.005, idle_sleep_s=0.0002,
                          host_pool=torch.zeros(1))
    header, ack, ids, mask = box.header.numpy(), box.ack.numpy(), box.ids_in.numpy(), box.mask_in.numpy()
    latencies = []
    try:
        for seq in range(1, args.jobs + 1):
            ids[:8] = [(seq * 8 + j) % args.experts for j in range(8)]
            mask[:8] = [1] * withheld + [0] * (8 - withheld)
            header[1:5] = [0, 1, 8, 6]
            t0 = time.perf_counter()
            header[0] = seq  # the sequence number last
            while ack[0] != seq:
                pass
            latencies.append(time.perf_counter() - t0)
            end = time.perf_counter() + args.gap_us * 1e-6
            while time.perf_counter() < end:
                pass
        jobs = worker.new_jobs()[args.jobs // 10:]
        counts = worker.count()
    finally:
        worker.close()
    e2e = statistics.median(latencies[args.jobs // 10:])
    kernels = statistics.median(j["kernel_ns"] for j in jobs) / 1e9
    return {"hidden": hidden, "inter": inter, "experts_per_job": withheld, "latency_us_median": round(e2e * 1e6, 1),
            "kernels_us_median": round(kernels * 1e6, 1),
            "worker_beyond_kernels_us_median": round(statistics.median(j["job_ns"] - j["kernel_ns"] for j in jobs) / 1e3, 1),
            "handover_us": round((e2e - kernels) * 1e6, 1),
            "kernel_gb_s": round(int(layouts[0, -1]) * withheld / kernels / 1e9, 3), "worker_errors": counts["errors"],
            "activations": worker.activations}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="the worker's threads")
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--experts", type=int, default=48)
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if native.load() is None:
        raise SystemExit(f"no native kernels: {native.reason()}")
    rows = [measure(h, i, k, args) for h, i, k in SHAPES]
    for row in rows:
        print(json.dumps(row))
    out = {"what": "native CPU-share worker, CPU protocol: post to answer, less the kernels' own time",
           "threads": args.threads, "jobs": args.jobs, "gap_us": args.gap_us, "rows": rows,
           "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "load_1min": round(os.getloadavg()[0], 2)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
