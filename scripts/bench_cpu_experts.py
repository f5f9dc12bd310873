"""How fast the CPU computes one token through one routed expert (moestream/kernels/cpu_experts.py),
in GB/s of expert record bytes, for each way of computing it, on N threads; then whole jobs of
several experts, one after another on torch's intra-op threads (the CPU share's form before the
job threads) against spread over job threads (moestream/kernels/cpu_expert_jobs.py); JSON out.

    python scripts/bench_cpu_experts.py --threads 16 --out docs/bench/cpu_experts_kernels.json
    python scripts/bench_cpu_experts.py --bits 4 --threads 1 2 --jobs 2 4 8 32 --job-threads 1 2 --busy 0 1 --out J

The shape defaults to Qwen3-30B-A3B's expert (hidden 2048, intermediate 768, group 64). Each timed
call uses the next of --experts distinct experts (more bytes than the last-level cache holds), so
weights come from RAM as they do when decoding. Also: repacking one expert (paid once per expert,
then kept) and dequantize-then-matmul in torch, the path the int kernels replace.

Jobs (4-bit records): a job is --jobs distinct experts (cycling through the --experts made), each
with --pairs-per-expert tokens; "sequential" runs its pairs one after another on the caller with
torch's intra-op threads at each --threads count, "parallel" hands the job to ExpertJobs with each
--job-threads count (every job thread, the caller among them, on one intra-op thread), for each
--busy count of spinning processes beside them; all of it --rounds times, the median kept. GB/s
are record bytes of the job's experts over the job's wall time, hand-over to the helpers included.
Also checked: that torch's intra-op thread count is per thread (set in one thread, read in another)."""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import threading
import time

import torch
import torch.nn.functional as F

from moestream.kernels.cpu_expert_jobs import ExpertJobs, default_job_threads
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


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def intra_op_count_is_per_thread() -> bool:
    """Set one intra-op count in a new thread: does this thread's stay as it was?"""
    mine = torch.get_num_threads()
    other = 1 if mine != 1 else 2
    seen = []

    def set_and_read():
        torch.set_num_threads(other)
        seen.append(torch.get_num_threads())

    t = threading.Thread(target=set_and_read)
    t.start()
    t.join()
    per_thread = seen == [other] and torch.get_num_threads() == mine
    torch.set_num_threads(mine)  # a thread that never ran a parallel op takes the last count set anywhere
    return per_thread


def tiny_jobs(dtype, job_threads: list[int]) -> dict:
    """Experts too small to cost anything but the calls (hidden 128, intermediate 64): one pair's
    microseconds (about what each pair holds the interpreter's lock for, the part of a job that job
    threads cannot run side by side), and per job-threads count n a job of n of them on n threads
    (its excess over one pair: waking the helpers and their turns at the lock)."""
    tiny = [repack(record(128, 64, 4, 64), {p: QuantSpec(4, 64) for p in PROJS}, dtype) for _ in range(max(job_threads))]
    x, rows = torch.randn(1, 128, dtype=dtype), torch.empty((len(tiny), 128))
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = {"pair_overhead_us": round(timed(lambda i: tiny[0].weighted_row_into(x, rows[0], 0.5), 2000) * 1e6, 2),
               "job_of_n_on_n_threads_us": {}}
        for n in job_threads:
            runner = ExpertJobs(n)
            job = [(tiny[i], x, rows[i], 0.5) for i in range(n)]
            try:
                out["job_of_n_on_n_threads_us"][n] = round(timed(lambda i: runner.run(job), 500) * 1e6, 1)
            finally:
                runner.close()
        return out
    finally:
        torch.set_num_threads(caller_threads)


@contextlib.contextmanager
def busy_cores(count: int):
    """`count` processes that spin, as the engine's thread waiting on the GPU does (processes:
    a spinning thread here would hold the interpreter's lock)."""
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(count)]
    try:
        time.sleep(0.2 if count else 0)  # they have started spinning
        yield
    finally:
        for p in spinners:
            p.kill()
            p.wait()


def busy_job_rows(packed, nbytes: int, args, dtype, busy: int) -> list[dict]:
    with busy_cores(busy):
        return job_rows(packed, nbytes, args, dtype, busy)


def median_row(rows: list[dict]) -> dict:
    """One configuration's row over the rounds: the median job time, with every round's GB/s."""
    mid = sorted(rows, key=lambda r: r["job_us"])[len(rows) // 2]
    return {**mid, "gb_s_rounds": [r["gb_s"] for r in rows]}


def job_rows(packed, nbytes: int, args, dtype, busy: int) -> list[dict]:
    """Jobs of --jobs experts, sequential on the intra-op pool and parallel on the job threads,
    beside `busy` spinning processes."""
    results = []
    caller_threads = torch.get_num_threads()
    for experts in args.jobs:
        jobs_cycled = max(1, len(packed) // experts)
        x = torch.randn(args.pairs_per_expert, args.hidden, dtype=dtype)
        rows = torch.empty((experts * args.pairs_per_expert, args.hidden), dtype=torch.float32)

        def pairs_of(i):
            start = (i % jobs_cycled) * experts
            return [(packed[(start + k) % len(packed)], x[t:t + 1], rows[k * args.pairs_per_expert + t], 0.5)
                    for k in range(experts) for t in range(args.pairs_per_expert)]

        jobs = [pairs_of(i) for i in range(jobs_cycled)]
        job_bytes = nbytes * experts
        base = {"experts": experts, "pairs_per_expert": args.pairs_per_expert, "job_bytes": job_bytes,
                "busy_cores": busy}

        def sequential(i):
            for expert, xr, out, w in jobs[i % jobs_cycled]:
                expert.weighted_row_into(xr, out, w)

        for threads in args.threads:
            torch.set_num_threads(threads)
            s = timed(sequential, 2 * jobs_cycled)
            results.append({**base, "form": "sequential", "intra_op_threads": threads, "job_us": round(s * 1e6, 1),
                            "gb_s": round(job_bytes / s / 1e9, 3)})
            print(json.dumps(results[-1]))
        for threads in args.job_threads:
            runner = ExpertJobs(threads)
            ExpertJobs.enter()  # this thread is one of the job threads
            try:
                s = timed(lambda i: runner.run(jobs[i % jobs_cycled]), 2 * jobs_cycled)
            finally:
                runner.close()
                torch.set_num_threads(caller_threads)
            gb_s = job_bytes / s / 1e9
            results.append({**base, "form": "parallel", "job_threads": threads, "job_us": round(s * 1e6, 1),
                            "gb_s": round(gb_s, 3), "gb_s_per_thread": round(gb_s / min(threads, experts), 3)})
            print(json.dumps(results[-1]))
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--inter", type=int, default=768)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--experts", type=int, default=48, help="distinct experts cycled through (default 48: ~130 MB at 4 bits)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--bits", type=int, nargs="+", default=[4, 8], choices=[4, 8])
    ap.add_argument("--jobs", type=int, nargs="*", default=[8, 32], help="experts per job (none: no job rows)")
    ap.add_argument("--pairs-per-expert", type=int, default=1, help="tokens of a job that chose each expert")
    ap.add_argument("--busy", type=int, nargs="+", default=[0],
                    help="jobs again beside this many spinning processes (the engine's thread waiting on the GPU)")
    ap.add_argument("--rounds", type=int, default=1, help="the job rows this many times, interleaved; medians")
    ap.add_argument("--job-threads", type=int, nargs="+",
                    default=sorted({1, 2, default_job_threads(), default_job_threads() + 1}))
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    results, jobs = [], []
    load = [os.getloadavg()[0]]
    for bits in args.bits:
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
        if bits == 4 and args.jobs:
            rounds = [[row for busy in args.busy for row in busy_job_rows(packed, nbytes, args, dtype, busy)]
                      for _ in range(args.rounds)]  # the int4 experts repacked above
            jobs = [median_row([r[i] for r in rounds]) for i in range(len(rounds[0]))]
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = {"what": "one token through one routed expert on the CPU, GB/s of record bytes; then jobs of several experts",
           "shape": {"hidden": args.hidden, "inter": args.inter, "group": args.group}, "dtype": args.dtype,
           "experts_cycled": args.experts, "torch": torch.__version__, "cpu": cpu_model(), "machine": platform.node(),
           "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": cores,
           "python": platform.python_version(), "intra_op_count_per_thread": intra_op_count_is_per_thread(),
           "command": "python scripts/bench_cpu_experts.py " + " ".join(
               f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
               for k, v in vars(args).items() if v is not None and k != "out"),
           "load_avg_1min_before_after": load + [os.getloadavg()[0]],
           "tiny_experts": tiny_jobs(dtype, args.job_threads) if args.jobs else None,
           "results": results, "jobs": jobs}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
            f.write("\n")


if __name__ == "__main__":
    main()
