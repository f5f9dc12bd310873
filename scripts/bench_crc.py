"""What checking every expert record costs: ISA-L's crc32 (the library's check) and zlib's against the read that brings the record in.

Times, on this machine, (a) crc32 of a record already in RAM, (b) a buffered pread of the record
from the page cache (warm file), (c) an O_DIRECT pread from the disk where the filesystem allows
it, for the demo model's record size and for a Qwen3-30B-A3B-sized 4-bit record. Writes JSON.

    python scripts/bench_crc.py --out docs/bench/crc32.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

from isal import isal_zlib

from moestream.bench.machine import machine_info
from moestream.experts.buffers import aligned_buffer

# demo record (57,344 B) and a Qwen3-30B-A3B expert at 4 bits, group 64 (3 x 768 x 2048 4-bit weights, bf16 scales and biases)
RECORD_SIZES = {"demo": 57344, "qwen3-30b-a3b-q4": 2_654_208}
FILE_BYTES = 256 << 20


def _rate(nbytes: int, seconds: list[float]) -> dict:
    best = min(seconds)
    med = statistics.median(seconds)
    return {"records_s": round(1 / med, 1), "gb_s": round(nbytes / med / 1e9, 3), "best_gb_s": round(nbytes / best / 1e9, 3),
            "median_us": round(med * 1e6, 2)}


def _time(fn, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def bench(size: int, path: Path, reps: int) -> dict:
    records = FILE_BYTES // size
    buf = aligned_buffer(size)
    view = memoryview(buf.numpy())
    offsets = [(i * 7919 % records) * size for i in range(reps)]  # scattered, like routed experts
    it = iter(offsets * 4)
    result = {"record_bytes": size}
    result["crc32"] = _rate(size, _time(lambda: isal_zlib.crc32(view), reps))
    result["crc32_zlib"] = _rate(size, _time(lambda: zlib.crc32(view), reps))
    fd = os.open(path, os.O_RDONLY)
    try:
        with open(path, "rb") as fh:  # warm the page cache
            while fh.read(8 << 20):
                pass
        result["read_page_cache"] = _rate(size, _time(lambda: os.preadv(fd, [view], next(it)), reps))
    finally:
        os.close(fd)
    if hasattr(os, "O_DIRECT"):
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            os.preadv(fd, [view], 0)
        except OSError as exc:
            result["read_o_direct"] = f"unavailable here: {exc.strerror}"
        else:
            try:
                result["read_o_direct"] = _rate(size, _time(lambda: os.preadv(fd, [view], next(it)), reps))
            finally:
                os.close(fd)
    result["crc_share_of_page_cache_read"] = round(result["crc32"]["median_us"] /
                                                   (result["crc32"]["median_us"] + result["read_page_cache"]["median_us"]), 3)
    if isinstance(result.get("read_o_direct"), dict):
        result["crc_share_of_direct_read"] = round(result["crc32"]["median_us"] /
                                                   (result["crc32"]["median_us"] + result["read_o_direct"]["median_us"]), 3)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", required=True)
    p.add_argument("--reps", type=int, default=400)
    p.add_argument("--dir", default=None, help="where to write the scratch file (default: a temp dir on the repo's disk)")
    args = p.parse_args()
    out = {"machine": machine_info(), "zlib": zlib.ZLIB_RUNTIME_VERSION, "file_bytes": FILE_BYTES, "reps": args.reps,
           "note": "median per record; crc32 (ISA-L's, the library's check) and crc32_zlib on one thread", "results": {}}
    with tempfile.TemporaryDirectory(dir=args.dir or Path(__file__).resolve().parent) as tmp:
        path = Path(tmp) / "records.bin"
        with open(path, "wb") as fh:
            for _ in range(FILE_BYTES >> 20):
                fh.write(os.urandom(1 << 20))
        for name, size in RECORD_SIZES.items():
            out["results"][name] = bench(size, path, args.reps)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["results"], indent=1))


if __name__ == "__main__":
    main()
