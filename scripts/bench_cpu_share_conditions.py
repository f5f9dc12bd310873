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

And what the records sit in (--memories): `mapped`, an anonymous mapping registered with CUDA (how
the host tier holds them: moestream.experts.buffers), `huge`, the same asking for transparent huge
pages (madvise; the H200 machine granted none), `pinned`, torch's pinned allocation; how many
distinct experts the jobs cycle through (--pools: fewer than the last-level cache holds, or many
more); how far ahead the row loops prefetch the codes (--prefetch); float or int8 activations.
Each cell reports the median job time, GB/s of record bytes and, with DMA, the copies' own GB/s
over the cell; each pool how much of it the kernel gave huge pages."""
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


def huge_kib(t: torch.Tensor) -> int:
    """KiB of `t`'s mapping in transparent huge pages (/proc/self/smaps; 0 where unknown)."""
    try:
        text = Path("/proc/self/smaps").read_text()
    except OSError:
        return 0
    inside = False
    for line in text.splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and ":" not in head:
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= t.data_ptr() < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def record_pool(memory: str, nbytes: int, cuda: bool) -> torch.Tensor:
    import mmap

    from moestream.experts.buffers import aligned_buffer, pin_if_cuda

    if memory == "pinned":
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    if memory == "mapped":
        return pin_if_cuda(aligned_buffer(nbytes))
    # huge: a mapping of its own, starting on a 2 MiB boundary, asking for huge pages before any is touched
    huge = 2 << 20
    mapping = mmap.mmap(-1, nbytes + huge)
    start = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
    if hasattr(mmap, "MADV_HUGEPAGE"):
        mapping.madvise(mmap.MADV_HUGEPAGE)
    t = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes, offset=-start % huge)
    if cuda:
        torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)  # unregistered with the process
    return t


def busy_wait(us: float) -> None:
    end = time.perf_counter() + us / 1e6
    while time.perf_counter() < end:
        pass


def cell(module, layout, addresses, n: int, threads: int, team: str, condition: str, args, copier, **labels) -> dict:
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
    row = {**labels, "experts_per_job": n, "threads": threads, "team": team, "condition": condition,
           "job_us": round(statistics.median(times) * 1e6, 1),
           "job_us_p90": round(sorted(times)[int(0.9 * len(times))] * 1e6, 1)}
    row["gb_s"] = round(n * int(layout[-1]) / statistics.median(times) / 1e9, 2)
    if dma:
        row["dma_gb_s"] = round(copier.stop(), 2)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[max(1, (os.cpu_count() or 2) - 2)])
    ap.add_argument("--teams", nargs="+", default=["spin-pinned"], choices=["omp", "spin", "spin-pinned"])
    ap.add_argument("--experts-per-job", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--conditions", nargs="+", default=["back-to-back", "dma+gaps"], choices=CONDITIONS)
    ap.add_argument("--memories", nargs="+", default=["mapped"], choices=["mapped", "huge", "pinned"])
    ap.add_argument("--pools", type=int, nargs="+", default=[24, 600],
                    help="distinct experts the jobs cycle through (24: ~64 MB, inside a large last-level cache; "
                         "600: ~1.6 GB, from RAM)")
    ap.add_argument("--prefetch", type=int, nargs="+", default=[0, 1024], help="bytes ahead the row loops prefetch")
    ap.add_argument("--activations", nargs="+", default=["float", "int8"], choices=["float", "int8"],
                    help="what the codes multiply: float32 inputs, or int8 ones (VNNI; float where not compiled in)")
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--bits", type=int, default=4, choices=[4, 8])
    ap.add_argument("--jobs", type=int, default=400, help="timed jobs per cell")
    ap.add_argument("--gap-us", type=float, default=150.0, help="busy wait between jobs in the gap conditions")
    ap.add_argument("--dma-mb", type=int, default=256, help="MB per copy of the DMA load")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    module = native_experts.load()
    if module is None:
        raise SystemExit(f"no native kernels: {native_experts.reason()}")
    cuda = torch.cuda.is_available()
    conditions = [c for c in args.conditions if cuda or "dma" not in c]
    quant = {p: QuantSpec(args.bits, args.group) for p in PROJS}
    blobs = [native_experts.record_blob(record(args.hidden, args.inter, args.bits, args.group, seed)) for seed in range(8)]
    layouts = {a: native_experts.layout(blobs[0][1], quant, int8_activations=a == "int8") for a in args.activations}
    layout = layouts[args.activations[0]]
    size = -(-blobs[0][0].numel() // 4096) * 4096
    copier = Copier(args.dma_mb) if cuda and any("dma" in c for c in conditions) else None
    alone = None
    if copier is not None:
        copier.start()
        for _ in range(20):
            copier.feed()
            time.sleep(0.01)
        alone = copier.stop()
        print(json.dumps({"dma_alone_gb_s": round(alone, 2)}), flush=True)
    rows, pools = [], []
    for memory in args.memories:
        for experts in args.pools:
            pool = record_pool(memory, experts * size, cuda)
            for e in range(experts):  # 8 records repeated: the addresses differ, so the bytes come from RAM all the same
                blob = blobs[e % len(blobs)][0]
                pool[e * size:e * size + blob.numel()] = blob
            addresses = torch.tensor([pool.data_ptr() + e * size for e in range(experts)], dtype=torch.int64)
            pools.append({"memory": memory, "experts": experts, "mb": round(pool.numel() / 1e6),
                          "huge_page_mb": round(huge_kib(pool) / 1e3)})
            print(json.dumps(pools[-1]), flush=True)
            for ahead in args.prefetch:
                module.set_prefetch(ahead)
                for acts, lay in layouts.items():
                    for n in args.experts_per_job:
                        for threads in args.threads:
                            for team in args.teams:
                                for condition in conditions:
                                    row = cell(module, lay, addresses, n, threads, team, condition, args, copier,
                                               memory=memory, pool=experts, prefetch=ahead, activations=acts)
                                    rows.append(row)
                                    print(json.dumps(row), flush=True)
            del pool, addresses
    module.set_prefetch(native_experts.prefetch_bytes())
    out = {"what": "native CPU-share jobs (one token) under a decode step's conditions, GB/s of record bytes",
           "record_bytes": int(layout[-1]), "pinned": cuda, "pools": pools,
           "gap_us": args.gap_us, "dma_mb": args.dma_mb, "dma_alone_gb_s": alone and round(alone, 2),
           "vnni": bool(getattr(module, "VNNI", False)), "cores": os.cpu_count(), "cpu": platform.processor() or platform.machine(),
           "gpu": torch.cuda.get_device_name() if cuda else None,
           "command": "python scripts/bench_cpu_share_conditions.py " + " ".join(
               f"--{k.replace('_', '-')}" + ("" if v is True else f" {' '.join(map(str, v)) if isinstance(v, list) else v}")
               for k, v in vars(args).items() if v not in (None, False) and k != "out"),
           "cells": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
