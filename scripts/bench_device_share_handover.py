"""The device-driven CPU share's hand-over on the CPU: how long a job takes from the moment its
sequence number is posted to the moment the answer is there, beyond the expert kernels' own time;
JSON out.

    PYTHONPATH=. python scripts/bench_device_share_handover.py --threads 1 --out docs/bench/device-share-handover.json

The mailbox is moestream.layers.device_cpu_share's own, and so is its worker thread; the device's
side is played by a second process (forked, numpy only: its polls never hold this process's GIL)
that writes each request (ids, header, then the sequence number) into the shared mailbox and spins
until the answer arrives, --gap-us apart (a layer's time on the device, so the worker stays in its
busy poll as during a step). Each job is --pairs (token, pick) pairs of one token of which --withheld
are the CPU's, each a 4-bit expert (default Qwen3-30B-A3B's: hidden 2048, intermediate 768, group 64)
cycled through --experts distinct ones so the weights come from RAM; --withheld 0 times the bare
hand-over (a job with no pair to compute), a small expert (--hidden 256 --inter 128) the per-pair
work around the kernels with little of their noise. The kernels' time alone is the same
pairs through the same repacked experts, called in a loop on the same thread count. Hand-over =
median job latency - median kernel time. Runs against any checkout with this mailbox layout (point
PYTHONPATH at it), so a before and an after are measured by the same script.

On a small machine shared with other work the end-to-end figure moves by tens of microseconds from
run to run (two processes, a worker thread, the scheduler), so the worker's own per-job steps are
also timed in this process alone, without the mailbox's polling ("worker_steps_us"): reading the
request and computing its withheld pair into the answer, the worker's own methods where the checkout
has them (`_request`, `_compute`), else its earlier steps (clone the inputs, convert x, one pair:
`ffn`, to float32, times the weight, into the answer), written out below; and `ffn` alone beside them."""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import subprocess
import time
from types import SimpleNamespace

import numpy as np
import torch

from moestream.kernels.cpu_experts import repack
from moestream.layers import device_cpu_share
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")


def record(hidden: int, inter: int, group: int) -> dict[str, torch.Tensor]:
    rec = {}
    for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}.items():
        w, s, b = quantize(torch.randn(rows, cols, dtype=torch.bfloat16) * 0.02, 4, group)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec


def device_side(header, ack, ids_in, jobs: int, pairs: int, withheld: int, experts: int, gap_s: float, out) -> None:
    """The forked 'device': post `jobs` requests one after the other, time each until its answer."""
    seq = int(header[0])
    for j in range(jobs):
        ids_in[:pairs] = [(j * withheld + p) % experts for p in range(pairs)]
        header[1:] = (0, 1, pairs, withheld)[:len(header) - 1]  # layer, tokens, pairs (, misses)
        seq += 1
        t0 = time.perf_counter()
        header[0] = seq  # last: the worker starts on it
        while ack[0] != seq and ack[0] != -seq:
            pass
        out[j] = time.perf_counter() - t0
        end = time.perf_counter() + gap_s
        while time.perf_counter() < end:
            pass


def kernels_alone(packed, x, w, pairs_rows: int, calls: int) -> float:
    """Seconds for one job's kernels: `pairs_rows` experts' rows computed and weighted, the median."""
    times = []
    rows = torch.empty((pairs_rows, x.shape[1]), dtype=torch.float32)
    for j in range(calls):
        t0 = time.perf_counter()
        for p in range(pairs_rows):
            rows[p] = packed[(j * pairs_rows + p) % len(packed)].ffn(x)[0].float() * w
        times.append(time.perf_counter() - t0)
    return float(np.median(times[len(times) // 10:]))


def worker_steps(ds, packed, pairs: int, calls: int) -> dict:
    """Median microseconds of one job's steps in the worker (one withheld pair), and of `ffn` alone."""
    header, ids_in, w_in, mask_in = ds.header.numpy(), ds.ids_in.numpy(), ds.w_in.numpy(), ds.mask_in.numpy()
    header[1:] = (0, 1, pairs, 1)[:len(header) - 1]
    ids_in[:pairs] = range(pairs)
    mask_in[:pairs] = 0
    mask_in[0] = 1  # one withheld pair, expert 0
    x_rows = [ds.x_in[0:1]]
    out_rows = [ds.rows_out[p] for p in range(pairs)]
    expert = packed[0]

    if hasattr(ds, "_request"):
        def job():
            layer, picks, _, ids, w, mine = ds._request(header, ids_in, w_in, mask_in)
            ds._compute(layer, picks, ids, w, mine, x_rows, out_rows)
    else:  # the earlier worker's steps
        def job():
            layer, tokens, n = (int(v) for v in header[1:4])
            x = ds.x_in[:tokens].clone()
            ids = ds.ids_in[:n].tolist()
            w = ds.w_in[:n].clone()
            mine = [p for p, m in enumerate(ds.mask_in[:n].tolist()) if m]
            xd = x.to(ds.dtype)
            for p in mine:
                ds.rows_out[p] = ds.cpu._repacked[(layer, ids[p])].ffn(xd[p // (n // tokens):p // (n // tokens) + 1])[0].float() * w[p]

    def alone():
        expert.ffn(x_rows[0])

    out = {}
    with torch.inference_mode():
        for name, fn in (("job", job), ("ffn", alone)) * 2:  # interleaved, the second round kept
            for _ in range(calls // 10):
                fn()
            times = []
            for _ in range(calls):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            out[name] = round(float(np.median(times)) * 1e6, 1)
    return {"worker_steps_us": out["job"], "ffn_alone_us": out["ffn"],
            "worker_steps_beyond_ffn_us": round(out["job"] - out["ffn"], 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1, help="the worker's intra-op threads")
    ap.add_argument("--jobs", type=int, default=400)
    ap.add_argument("--pairs", type=int, default=8, help="a call's (token, pick) pairs (Qwen3-30B-A3B: 8 picks)")
    ap.add_argument("--withheld", type=int, default=1, help="of them the CPU's, each its own expert")
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--gap-us", type=float, default=300.0)
    ap.add_argument("--label", default="")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    hidden, inter, group, dtype = args.hidden, args.inter, 64, torch.bfloat16
    quant = {p: QuantSpec(4, group) for p in PROJS}
    recs = [record(hidden, inter, group) for _ in range(args.experts)]
    nbytes = sum(t.nbytes for t in recs[0].values())
    packed = [repack(r, quant, dtype) for r in recs]
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, hidden, generator=g).to(dtype)
    kernel_s = kernels_alone(packed, x, 0.3, args.withheld, args.jobs) if args.withheld else 0.0
    # the mailbox in shared memory, so the forked 'device' sees the worker's answers
    device_cpu_share._pinned = lambda shape, dt, cuda: torch.zeros(shape, dtype=dt).share_memory_()
    cpu = SimpleNamespace(share=0.5, threads=args.threads, dtype=dtype, record_bytes={0: nbytes}, fault_delay_s=0.0,
                          fault_after=None, cpu_gb_s=None, _repacked={(0, e): packed[e] for e in range(args.experts)},
                          stats=dict)
    with torch.inference_mode():
        ds = device_cpu_share.DeviceCpuShare(cpu, device=torch.device("cpu"), hidden=hidden, max_tokens=1, dtype=dtype,
                                             timeout_s=1.0)
        ds.x_in[0].copy_(x[0])
        ds.w_in[:args.pairs] = 0.3
        ds.mask_in[:args.pairs] = torch.tensor([1] * args.withheld + [0] * (args.pairs - args.withheld))
    time.sleep(0.5)  # the worker's start (and its warm-up, where it has one)
    out = multiprocessing.get_context("fork").Array("d", args.jobs, lock=False)
    child = multiprocessing.get_context("fork").Process(
        target=device_side, args=(ds.header.numpy(), ds.ack.numpy(), ds.ids_in.numpy(), args.jobs, args.pairs,
                                  args.withheld, args.experts, args.gap_us * 1e-6, out))
    child.start()
    child.join()
    ds.close()
    jobs, errors = ds.jobs, ds.errors
    steps = worker_steps(ds, packed, args.pairs, 2000)
    if child.exitcode != 0:
        raise SystemExit(f"the device's process failed (exit code {child.exitcode})")
    lat = np.array(out[:])[args.jobs // 10:]  # the first tenth: start-up
    median = float(np.median(lat))
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(device_cpu_share.__file__)).stdout.strip() or None
    except OSError:
        commit = None
    result = {"what": "device-driven CPU share, CPU protocol: job latency from the posted sequence number to the "
                      "answer, less the kernels' own time",
              "label": args.label, "code": commit, "jobs_timed": len(lat), "threads": args.threads,
              "pairs": args.pairs, "withheld": args.withheld, "hidden": hidden, "inter": inter, "record_bytes": nbytes, "gap_us": args.gap_us,
              "latency_us_median": round(median * 1e6, 1), "latency_us_p10": round(float(np.percentile(lat, 10)) * 1e6, 1),
              "latency_us_p90": round(float(np.percentile(lat, 90)) * 1e6, 1),
              "kernels_us_median": round(kernel_s * 1e6, 1), "handover_us": round((median - kernel_s) * 1e6, 1),
              "worker_jobs": jobs, "worker_errors": errors, **steps,
              "torch": torch.__version__, "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
              "load_1min": round(os.getloadavg()[0], 2)}
    print(json.dumps(result))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
