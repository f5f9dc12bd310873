"""How fast can the GPU pull expert records out of pinned host RAM by itself?

Compares, for k records of the Qwen3-30B-A3B size scattered in a pinned host pool: k async
copies from the host (the copy engine, what the host path does), and a device gather that reads the
host pool through its unified address (a Triton kernel, and torch's index_select) with no host
work per record. Writes JSON. Usage: python scripts/gpu/probe_uva.py OUT.json"""
from __future__ import annotations

import json
import sys
import time

import torch

from moestream.experts.buffers import aligned_buffer, pin_if_cuda
from moestream.experts.uva import device_view
from moestream.kernels.triton_gather import gather_records

RECORD = 2_654_208  # bytes of one Qwen3-30B-A3B 4-bit expert record (page aligned)
HOST_RECORDS = 1024


def timed(fn, reps=20) -> float:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def main(out: str) -> None:
    host = pin_if_cuda(aligned_buffer(HOST_RECORDS * RECORD).view(HOST_RECORDS, RECORD))
    host.view(-1)[:: 4093].random_(0, 255)
    view = device_view(host)
    dev = torch.empty((256, RECORD), dtype=torch.uint8, device="cuda")
    results = {"record_bytes": RECORD, "gpu": torch.cuda.get_device_name(), "rows": []}
    g = torch.Generator().manual_seed(0)
    for k in (1, 8, 16, 32, 64):
        src = torch.randperm(HOST_RECORDS, generator=g)[:k]
        dst = torch.randperm(256, generator=g)[:k]
        src_d, dst_d = src.cuda(), dst.cuda()
        mask = torch.ones(k, dtype=torch.bool, device="cuda")

        def engine():
            for s, d in zip(src.tolist(), dst.tolist()):
                dev[d].copy_(host[s], non_blocking=True)

        def gather():
            gather_records(view, dev, src_d, dst_d, mask)

        def index_select():
            dev.index_copy_(0, dst_d, view.index_select(0, src_d))

        row = {"records": k}
        for name, fn in (("copy_engine", engine), ("uva_triton", gather), ("uva_index_select", index_select)):
            s = timed(fn)
            row[f"{name}_gb_s"] = round(k * RECORD / s / 1e9, 2)
        gather()
        torch.cuda.synchronize()
        row["uva_exact"] = bool(torch.equal(dev[dst_d].cpu(), host[src]))
        results["rows"].append(row)
        print(row, flush=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
