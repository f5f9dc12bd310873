"""The disk's read bandwidth, page cache bypassed (O_DIRECT), over a packed model's expert files: whole
records at random offsets by N threads at once, and the files end to end in 16 MiB reads. What a
streamed run's `disk_gb_s_while_waiting` is compared with.

    python scripts/disk_read_bw.py MODEL [--threads 8,32] [--seconds 3] [--out F.json]
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import threading
import time
from pathlib import Path

SEQUENTIAL_BLOCK = 16 << 20


def read_for(paths: list[Path], block: int, threads: int, seconds: float, *, at_random: bool) -> float:
    """GB/s of `threads` threads each reading `block`-byte pieces for `seconds`."""
    fds = [os.open(p, os.O_RDONLY | os.O_DIRECT) for p in paths]
    sizes = [os.path.getsize(p) // block for p in paths]
    total, lock, stop = [0], threading.Lock(), time.perf_counter() + seconds

    def work(seed: int) -> None:
        buf, rng, n, at = mmap.mmap(-1, block), random.Random(seed), 0, seed
        while time.perf_counter() < stop:
            f = rng.randrange(len(fds)) if at_random else at % len(fds)
            piece = rng.randrange(sizes[f]) if at_random else (at // len(fds)) % sizes[f]
            n += os.preadv(fds[f], [buf], piece * block)
            at += threads
        with lock:
            total[0] += n

    start = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    for fd in fds:
        os.close(fd)
    return total[0] / elapsed / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--threads", default="8,32")
    ap.add_argument("--seconds", type=float, default=3.0)
    ap.add_argument("--out")
    a = ap.parse_args()
    manifest = json.loads((Path(a.model) / "moestream.json").read_text())
    layers = manifest["expert_layers"]
    paths = sorted({Path(a.model) / e["file"] for e in layers})
    record = max(e["record_size"] for e in layers)
    result = {"command": "python scripts/disk_read_bw.py " + " ".join(os.sys.argv[1:]),
              "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count()},
              "files": len(paths), "record_bytes": record, "random_records_gb_s": {}, "sequential_16mib_gb_s": {}}
    for t in (int(x) for x in a.threads.split(",")):
        result["random_records_gb_s"][t] = round(read_for(paths, record, t, a.seconds, at_random=True), 3)
        result["sequential_16mib_gb_s"][t] = round(read_for(paths, SEQUENTIAL_BLOCK, t, a.seconds, at_random=False), 3)
    result["best_gb_s"] = max(*result["random_records_gb_s"].values(), *result["sequential_16mib_gb_s"].values())
    text = json.dumps(result, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
