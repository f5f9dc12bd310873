"""The CPU as a second compute unit for a streamed layer's missed experts (`--cpu-experts`).

When a layer's chosen ids reach the host, some of its misses have their records in host RAM (the
host tier). Copying one to the device costs record bytes / link speed; the CPU can instead compute
its (token, pick) pairs from its own repacked copy of those bytes with torch's int kernels
(moestream.kernels.cpu_experts), on a worker thread, while the device copies and computes the rest.
Those experts are not loaded: their slot table entries stay -1, and the CPU's weighted rows take
their pairs' places before the layer's per-token sum.

  - repacked up front: the CPU kernels need each record repacked into their format (milliseconds:
    ~70x computing it), far too slow to do when an expert is first offered (with uniform routing
    nearly every one is new). So once the host tier is filled, `repack_host_tier` repacks every
    record of it the kernels can take, on a pool of threads, and keeps them for the engine's life
    (about the record's bytes each: 4-bit in bf16 the same, 8-bit as two int4 halves ~1.06x,
    float32 scales more; the memory ledger counts them). Where RAM for all of them is not
    available, it repacks what fits and says so. A decode step never repacks. The device-driven
    path's native worker (moestream.layers.native_worker) computes from the records as they are,
    so with it nothing is repacked.
  - share: only repacked experts go to the CPU. A float f in 0..1 gives it floor(f * misses + 0.5)
    of a layer's misses (at most the repacked ones); "auto" the number that makes both finish
    together, from an EMA of the CPU's GB/s (the job's whole latency, as the caller waits for it)
    and of the copy GB/s.
  - threads: the worker runs torch's kernels on its own intra-op thread count (OpenMP's is per
    thread), so the caller's stays as it was.
  - fail-closed: an error, or no result within `timeout_s`, hands the experts back to the caller,
    which loads them on the device and computes them there (counted as `cpu_fallbacks`). A worker
    still running after a timeout is left to finish; no layer gets a CPU share until it has.
  - layouts the CPU kernels cannot compute (activations other than SwiGLU, group sizes torch's
    kernel refuses, ...) are logged once, never repacked and never given to the CPU.

Which experts the CPU computes depends on the cache and the timing, and its kernels round
differently from the device's, so with a CPU share the output is the reference's within the
dtype's tolerance, not bit for bit; `off` is never touched by any of this."""
from __future__ import annotations

import logging
import math
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor, as_completed
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch

from moestream.experts.sizing import format_bytes
from moestream.format.records import decode_record
from moestream.kernels.cpu_experts import compute_dtype, refusal, repack, repacked_nbytes

log = logging.getLogger(__name__)
EMA = 0.25  # weight of the newest measurement in the speed averages
START_CPU_GB_S = 10.0  # first guesses for auto, until something has been measured
START_COPY_GB_S = 25.0
RAM_KEPT_FREE = 2 << 30  # what the up-front repack leaves of the available RAM (the OS, other processes)


def parse_share(text: str) -> str | float:
    """--cpu-experts: "off", "auto", or a share in 0..1; a ValueError with one line otherwise."""
    text = str(text).strip().lower()
    if text in ("off", "auto"):
        return text
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"{text!r} is not off, auto or a share between 0 and 1") from None
    if not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"the share must be between 0 and 1, not {text}")
    return value


def available_ram() -> int:
    """Bytes of RAM the system can give without swapping (psutil; else /proc/meminfo's MemAvailable)."""
    try:
        import psutil
    except ImportError:
        psutil = None
    if psutil is not None:
        return int(psutil.virtual_memory().available)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("cannot tell how much RAM is available (no psutil, no MemAvailable in /proc/meminfo)")


def default_repack_workers() -> int:
    """Threads for the up-front repack: one per core this process may use (each repacks whole
    records on one intra-op thread: records are independent, an operator's own threads are not)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class CpuShareFailed(RuntimeError):
    pass


@dataclass
class CpuJob:
    """One layer call's CPU share: the experts, the (token, pick) pairs p = t*A + a they own, and
    the worker's future (weighted float32 rows [len(pairs), H], in the order of `pairs`)."""

    layer: int
    experts: list[int]
    pairs: list[int]
    future: Future
    started: float
    total: int = 0  # pairs of the layer call (T*A)


@dataclass
class CpuShareStats:
    jobs: int = 0
    experts: int = 0
    pairs: int = 0
    fallbacks: int = 0  # experts handed back to the device (error or timeout)
    timeouts: int = 0
    errors: int = 0
    bytes: int = 0  # record bytes of the experts computed
    compute_s: float = 0.0  # the kernels' time in the worker
    wait_s: float = 0.0  # the caller's time waiting for results
    repacks: int = 0
    repack_s: float = 0.0  # summed over the repack threads
    repack_wall_s: float = 0.0
    repack_workers: int = 0
    repack_left_out: int = 0  # records the kernels could take that found no RAM
    repack_errors: int = 0
    not_repacked: int = 0  # misses offered that were not repacked (so never the CPU's)
    skipped_busy: int = 0  # layers that got no share because the worker was still busy
    refused_layers: list = field(default_factory=list)


class CpuShare:
    def __init__(self, provider, layers, *, share: str | float, dtype: torch.dtype, timeout_s: float = 1.0,
                 threads: int = 0):
        """provider: the ExpertCache (needs `holds`, `host_view`, `record_fields`, `quant`).
        layers: the MoE layer indices. threads: the worker's intra-op threads (0: the caller's)."""
        if share == "off" or share is None:
            raise ValueError("CpuShare is for a share other than off")
        self.provider, self.share, self.timeout_s = provider, share, float(timeout_s)
        self.dtype = compute_dtype(dtype)
        self.threads = threads or torch.get_num_threads()
        self.st = CpuShareStats()
        self.refused: dict[int, str | None] = {}
        self.record_bytes: dict[int, int] = {}
        self.repacked_bytes_each: dict[int, int] = {}
        for layer in layers:
            fields, quant = provider.record_fields(layer), provider.quant(layer)
            self.refused[layer] = refusal(fields, quant)
            self.record_bytes[layer] = sum(f.nbytes for f in fields)
            if self.refused[layer]:
                log.info("layer %d: no CPU share (%s)", layer, self.refused[layer])
                self.st.refused_layers.append(layer)
            else:
                self.repacked_bytes_each[layer] = repacked_nbytes(fields, quant, self.dtype)
        self._repacked: dict = {}  # (layer, expert) -> CpuExpert, kept for the engine's life
        self._repacked_bytes = 0
        self._lock = threading.Lock()  # guards the repacked weights and the stats the threads update
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-cpu-experts",
                                            initializer=torch.set_num_threads, initargs=(self.threads,))
        self._last: Future | None = None
        self.cpu_gb_s: float | None = None  # EMAs (auto)
        self.copy_gb_s: float | None = None
        self._copy_timings: list = []  # (start event, end event, bytes) not yet complete (CUDA)
        # fault injection for tests: jobs after the first `fault_after` fail; each job first sleeps fault_delay_s
        self.fault_after: int | None = None
        self.fault_delay_s: float = 0.0

    # -- repacking, once ---------------------------------------------------------------------------
    def repack_host_tier(self, records: Iterable[tuple[int, int]], *, workers: int = 0) -> int:
        """Repack the host tier's `records` ((layer, expert), in order) that the kernels can take and
        are not repacked yet, on `workers` threads (0: one per core), as many as the available RAM
        holds. Returns the records repacked."""
        todo = [key for key in records if not self.refused.get(key[0], "not an MoE layer") and key not in self._repacked]
        room = available_ram() - RAM_KEPT_FREE
        fits, need = [], 0
        for key in todo:
            nbytes = self.repacked_bytes_each[key[0]]
            if need + nbytes <= room:
                fits.append(key)
                need += nbytes
        if len(fits) < len(todo):
            self.st.repack_left_out += len(todo) - len(fits)
            log.warning("RAM for %d of the %d experts the CPU could take (%s available, %s kept free): "
                        "the CPU computes only those", len(fits), len(todo), format_bytes(max(0, room + RAM_KEPT_FREE)),
                        format_bytes(RAM_KEPT_FREE))
        if not fits:
            return 0
        workers = max(1, workers or default_repack_workers())
        caller_threads = torch.get_num_threads()
        t0 = time.perf_counter()
        from tqdm import tqdm

        try:
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="moestream-repack",
                                    initializer=torch.set_num_threads, initargs=(1,)) as pool:
                futures = [pool.submit(self._repack_one, *key) for key in fits]
                for future in tqdm(as_completed(futures), total=len(futures), desc="repacking experts for the CPU",
                                   unit="expert", disable=None, leave=False):
                    future.result()
        finally:  # a thread that never ran a parallel op takes the last count set anywhere: give it back
            torch.set_num_threads(caller_threads)
        wall = time.perf_counter() - t0
        st = self.st
        st.repack_wall_s += wall
        st.repack_workers = workers
        done = len(fits) - st.repack_errors
        log.info("repacked %d experts for the CPU share in %.1f s on %d threads (%s of RAM)", done, wall, workers,
                 format_bytes(self._repacked_bytes))
        return done

    def _repack_one(self, layer: int, expert: int) -> None:
        view = self.provider.host_view(layer, expert)
        if view is None:
            return
        record, release = view
        t0 = time.perf_counter()
        try:
            weights = repack(decode_record(self.provider.record_fields(layer), record), self.provider.quant(layer),
                             self.dtype)
        except Exception as exc:  # noqa: BLE001 - an expert that cannot be repacked stays the device's
            with self._lock:
                self.st.repack_errors += 1
            log.warning("layer %d expert %d: not repacked for the CPU (%s)", layer, expert, exc)
            return
        finally:
            if release is not None:
                release()
        seconds = time.perf_counter() - t0
        with self._lock:
            self._repacked[(layer, expert)] = weights
            self._repacked_bytes += weights.nbytes
            self.st.repacks += 1
            self.st.repack_s += seconds

    def set_threads(self, threads: int) -> None:
        """The worker's intra-op threads from its next job on (a new worker thread; the old one finishes)."""
        self._executor.shutdown(wait=True)
        self.threads = threads
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-cpu-experts",
                                            initializer=torch.set_num_threads, initargs=(threads,))

    def is_repacked(self, layer: int, expert: int) -> bool:
        return (layer, expert) in self._repacked

    # -- choosing ---------------------------------------------------------------------------------
    def busy(self) -> bool:
        return self._last is not None and not self._last.done()

    def start(self, layer: int, experts: list[int], ids_host: list[int], x: torch.Tensor,
              weights: torch.Tensor) -> CpuJob | None:
        """Give the CPU its share of `layer`'s misses and start it; None where it gets nothing.
        experts: the distinct chosen ids (sorted); ids_host: [T*A] the chosen ids, pair order;
        x [T, H] the experts' input and weights [T, A] (device tensors, copied here)."""
        if self.refused.get(layer, "not an MoE layer"):
            return None
        if self.busy():
            self.st.skipped_busy += 1
            return None
        misses = [e for e in experts if not self.provider.holds(layer, e)]
        if not misses:
            return None
        ready = [e for e in misses if (layer, e) in self._repacked]  # written only before the first step
        self.st.not_repacked += len(misses) - len(ready)
        picked = self._pick(layer, len(misses), ready)
        if not picked:
            return None
        A = len(ids_host) // x.shape[0]
        chosen = set(picked)
        pairs = [p for p, e in enumerate(ids_host) if e in chosen]
        x_host, w_host = x.detach().to("cpu"), weights.detach().to("cpu", torch.float32)
        number = self.st.jobs
        self.st.jobs += 1
        started = time.perf_counter()
        future = self._executor.submit(self._compute, number, started, layer, picked, x_host, w_host,
                                       [ids_host[p] for p in pairs], [(p // A, p % A) for p in pairs])
        self._last = future
        return CpuJob(layer, picked, pairs, future, started)

    def _pick(self, layer: int, misses: int, ready: list[int]) -> list[int]:
        """How many of the repacked misses the CPU takes: a share, or (auto) the count after which
        giving it one more would no longer shorten max(CPU time, copy time of the rest)."""
        if self.share != "auto":
            return ready[:min(len(ready), math.floor(self.share * misses + 0.5))]
        self._collect_copy_timings()
        nbytes = self.record_bytes[layer]
        cpu_each = nbytes / ((self.cpu_gb_s or START_CPU_GB_S) * 1e9)
        copy_each = nbytes / ((self.copy_gb_s or START_COPY_GB_S) * 1e9)
        best, best_t = 0, misses * copy_each
        for c in range(1, len(ready) + 1):
            t = max(c * cpu_each, (misses - c) * copy_each)
            if t < best_t:
                best, best_t = c, t
        return ready[:best]

    # -- the worker -------------------------------------------------------------------------------
    def _compute(self, number: int, started: float, layer: int, experts: list[int], x: torch.Tensor,
                 w: torch.Tensor, pair_experts: list[int], pair_ta: list[tuple[int, int]]) -> torch.Tensor:
        if self.fault_delay_s:
            time.sleep(self.fault_delay_s)
        if self.fault_after is not None and number >= self.fault_after:
            raise RuntimeError(f"injected fault in CPU job {number}")
        weights = {e: self._repacked[(layer, e)] for e in experts}
        t0 = time.perf_counter()
        rows = torch.empty((len(pair_ta), x.shape[1]), dtype=torch.float32)
        for i, (e, (t, a)) in enumerate(zip(pair_experts, pair_ta)):  # one pair at a time: bits never depend on T
            rows[i] = weights[e].ffn(x[t:t + 1])[0].float() * w[t, a]
        done = time.perf_counter()
        with self._lock:
            self.st.compute_s += done - t0
            # auto's speed is the whole job's, hand-over included: what the caller will wait for
            rate = self.record_bytes[layer] * len(experts) / max(done - started, 1e-9) / 1e9
            self.cpu_gb_s = rate if self.cpu_gb_s is None else (1 - EMA) * self.cpu_gb_s + EMA * rate
        return rows

    # -- joining ----------------------------------------------------------------------------------
    def wait(self, job: CpuJob) -> torch.Tensor:
        """The job's rows; CpuShareFailed (counted as fallbacks) on an error or after timeout_s."""
        left = max(0.0, self.timeout_s - (time.perf_counter() - job.started))
        t0 = time.perf_counter()
        try:
            rows = job.future.result(timeout=left)
        except FutureTimeout:
            self.st.timeouts += 1
            self.st.fallbacks += len(job.experts)
            raise CpuShareFailed(f"layer {job.layer}: the CPU share took longer than {self.timeout_s} s") from None
        except Exception as exc:  # noqa: BLE001 - any failure of the worker falls back to the device
            self.st.errors += 1
            self.st.fallbacks += len(job.experts)
            log.warning("layer %d: CPU share failed (%s); computing its experts on the device", job.layer, exc)
            raise CpuShareFailed(str(exc)) from exc
        finally:
            self.st.wait_s += time.perf_counter() - t0
        self.st.experts += len(job.experts)
        self.st.pairs += len(job.pairs)
        self.st.bytes += self.record_bytes[job.layer] * len(job.experts)
        return rows

    # -- the copy side's speed (auto) -------------------------------------------------------------
    def copy_clock(self) -> Callable[[int], None] | None:
        """Before a layer's device loads: a function to call after them with the host-tier bytes they
        copied. CUDA: timing events on the cache's copy stream, read later without waiting."""
        if self.share != "auto":
            return None
        stream = getattr(self.provider, "copy_stream", None)
        if stream is None:
            t0 = time.perf_counter()

            def done(nbytes: int) -> None:
                self._add_copy(nbytes, time.perf_counter() - t0)
            return done
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)

        def done_cuda(nbytes: int) -> None:
            if nbytes:
                end = torch.cuda.Event(enable_timing=True)
                end.record(stream)
                self._copy_timings.append((start, end, nbytes))
        return done_cuda

    def _collect_copy_timings(self) -> None:
        keep = []
        for start, end, nbytes in self._copy_timings:
            if end.query():
                self._add_copy(nbytes, start.elapsed_time(end) / 1e3)
            else:
                keep.append((start, end, nbytes))
        self._copy_timings = keep

    def _add_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes and seconds > 0:
            rate = nbytes / seconds / 1e9
            self.copy_gb_s = rate if self.copy_gb_s is None else (1 - EMA) * self.copy_gb_s + EMA * rate

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        st = self.st
        with self._lock:
            held, held_bytes = len(self._repacked), self._repacked_bytes
        return {"cpu_share": self.share, "cpu_experts": st.experts, "cpu_pairs": st.pairs,
                "cpu_fallbacks": st.fallbacks, "cpu_timeouts": st.timeouts, "cpu_errors": st.errors,
                "cpu_bytes": st.bytes, "cpu_compute_s": round(st.compute_s, 6), "cpu_wait_s": round(st.wait_s, 6),
                "cpu_gb_s": round(st.bytes / st.compute_s / 1e9, 3) if st.compute_s > 0 and st.bytes else None,
                "cpu_gb_s_ema": round(self.cpu_gb_s, 3) if self.cpu_gb_s else None,
                "copy_gb_s_ema": round(self.copy_gb_s, 3) if self.copy_gb_s else None,
                "cpu_repacks": st.repacks, "cpu_repack_s": round(st.repack_s, 6),
                "cpu_repack_wall_s": round(st.repack_wall_s, 6), "cpu_repack_workers": st.repack_workers,
                "cpu_repack_left_out": st.repack_left_out, "cpu_repack_errors": st.repack_errors,
                "cpu_repacked_experts": held, "cpu_repacked_bytes": held_bytes, "cpu_not_repacked": st.not_repacked,
                "cpu_skipped_busy": st.skipped_busy, "cpu_refused_layers": list(st.refused_layers)}

    def close(self) -> None:
        self._executor.shutdown(wait=True)
