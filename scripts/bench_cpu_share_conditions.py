"""How fast the native CPU-share kernels compute a job under a decode step's conditions; JSON out.

    python scripts/bench_cpu_share_conditions.py --threads 9 14 --out cpu-share-conditions.json

Alone, back to back, 16 threads compute 50 GB/s of expert records (scripts/bench_cpu_experts.py);
inside a streamed step the same kernels measured 18. This separates the suspects, one job size
at a time (--experts-per-job, one token), for each team (--teams: OpenMP's region per job, the
worker's spinning team, the same pinned to cores) and thread count:

  - back-to-back: jobs one after another (the standalone figure);
  - gaps:         a busy wait of --gap-us between jobs, as the step's layers leave between them
                  (a team that parks its threads pays their wake-up);
  - dma:          back to back while the GPU copies from another pinned buffer of host RAM as fast as
                  it can (CUDA only): the copies and the kernels share the host's memory bandwidth;
  - dma+gaps:     both.

The records sit in pinned host RAM (as the host tier's do) unless --plain; each job takes the next
experts of --pool distinct ones (more than the last-level cache holds). Each cell reports the
median job time, GB/s of record bytes and, with DMA, the copies' own GB/s over the cell."""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from moestream.kernels import native_experts
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")
CONDITIONS = ("back-to-back", "gaps", "dma", "dma+gaps")


def record(hidden: int, inter: int, bits: int, group: int, seed: int) -> dict[str, torch.Tensor]:
    g, rec = torch.Generator().manual_seed(seed), {}
    for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
        w, s, b = quantize((torch.randn(rows, cols, generator=g) * 0.02).bfloat16(), bits, group)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec


class Copier:
    """Keeps the GPU copying from a pinned host buffer on a side stream (DMA, as the step's misses
    do), --dma-mb per copy, a few in flight; `gb_s` over the time it ran."""

    def __init__(self, mb: int):
        self.src = torch.empty(mb << 20, dtype=torch.uint8).pin_memory()
        self.dst = torch.empty_like(self.src, device="cuda")
        self.stream = torch.cuda.Stream()
        self.pending: list[torch.cuda.Event] = []
        self.copies = 0
        self.t0 = 0.0

    def start(self) -> None:
        torch.cuda.synchronize()
        self.copies, self.t0 = 0, time.perf_counter()
        self.feed()

    def feed(self) -> None:
        self.pending = [e for e in self.pending if not e.query()]
        with torch.cuda.stream(self.stream):
            while len(self.pending) < 3:
                self.dst.copy_(self.src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self.stream)
                self.pending.append(event)
                self.copies += 1

    def stop(self) -> float:
        self.stream.synchronize()
        return self.copies * self.src.numel() / (time.perf_counter() - self.t0) / 1e9


def busy_wait(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def cell(module, layout, addresses, n: int, threads: int, team: str, condition: str, args, copier) -> dict:
    x = torch.randn(1, args.hidden)
    out = torch.empty(n, args.hidden)
    picks, zeros, ones = torch.arange(n, dtype=torch.int32), torch.zeros(n, dtype=torch.int32), torch.ones(n)
    pool = addresses.numel()

    def job(i: int) -> float:
        start = (i * n) % (pool - n + 1)
        t0 = time.perf_counter()
        module.weighted_rows(layout, addresses[start:start + n], picks, zeros, ones, x, out, threads, team)
        return time.perf_counter() - t0

    for i in range(8):  # the team started, the code warm
        job(i)
    gaps, dma = "gaps" in condition, "dma" in condition
    if dma:
        copier.start()
    times = []
    for i in range(args.jobs):
        if gaps:
            busy_wait(args.gap_us)
        if dma:
            copier.feed()
        times.append(job(i))
    row = {"experts_per_job": n, "threads": threads, "team": team, "condition": condition,
           "job_us": round(statistics.median(times) * 1e6, 1),
           "job_us_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1)}
    row["gb_s"] = round(n * int(layout[-1]) / statistics.median(times) / 1e9, 2)
    if dma:
        row["dma_gb_s"] = round(copier.stop(), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[max(1, (os.cpu_count() or 2) - 2)])
    ap.add_argument("--teams", nargs="+", default=["omp", "spin", "spin-pinned"], choices=["omp", "spin", "spin-pinned"])
    ap.add_argument("--experts-per-job", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--conditions", nargs="+", default=list(CONDITIONS), choices=CONDITIONS)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--pool", type=int, default=96, help="distinct experts the jobs cycle through (default 96: ~250 MB)")
    ap.add_argument("--jobs", type=int, default=400, help="timed jobs per cell")
    ap.add_argument("--gap-us", type=float, default=150.0, help="busy wait between jobs in the gap conditions")
    ap.add_argument("--dma-mb", type=int, default=256, help="MB per copy of the DMA load")
    ap.add_argument("--plain", action="store_true", help="records in plain (pageable) RAM, not pinned")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    module = native_experts.load()
    if module is None:
        raise SystemExit(f"no native kernels: {native_experts.reason()}")
    cuda = torch.cuda.is_available()
    conditions = [c for c in args.conditions if cuda or "dma" not in c]
    quant = {p: QuantSpec(args.bits, args.group) for p in PROJS}
    blob, fields = native_experts.record_blob(record(args.hidden, args.inter, args.bits, args.group, 0))
    layout = native_experts.layout(fields, quant)
    size = -(-blob.numel() // 4096) * 4096
    pool = torch.empty(args.pool * size, dtype=torch.uint8)
    if cuda and not args.plain:
        pool = pool.pin_memory()
    for e in range(args.pool):  # 8 records repeated: the addresses differ, so every job reads RAM all the same
        b = blob if e < 1 else native_experts.record_blob(record(args.hidden, args.inter, args.bits, args.group, e % 8))[0]
        pool[e * size:e * size + b.numel()] = b
    addresses = torch.tensor([pool.data_ptr() + e * size for e in range(args.pool)], dtype=torch.int64)
    copier = Copier(args.dma_mb) if cuda and any("dma" in c for c in conditions) else None
    if copier is not None:
        copier.start()
        for _ in range(20):
            copier.feed()
            time.sleep(0.01)
        alone = copier.stop()
        print(json.dumps({"dma_alone_gb_s": round(alone, 2)}), flush=True)
    rows = []
    for n in args.experts_per_job:
        for threads in args.threads:
            for team in args.teams:
                for condition in conditions:
                    row = cell(module, layout, addresses, n, threads, team, condition, args, copier)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    out = {"what": "native CPU-share jobs (one token) under a decode step's conditions, GB/s of record bytes",
           "record_bytes": int(layout[-1]), "records": "plain RAM" if args.plain or not cuda else "pinned RAM",
           "gap_us": args.gap_us, "dma_mb": args.dma_mb, "dma_alone_gb_s": round(alone, 2) if copier else None,
           "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
           "gpu": torch.cuda.get_device_name() if cuda else None,
           "command": "python scripts/bench_cpu_share_conditions.py " + " ".join(
               f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
               for k, v in vars(args).items() if v not in (None, False) and k != "out"),
           "cells": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
