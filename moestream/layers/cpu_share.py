"""The CPU as a second compute unit for a streamed layer's missed experts (`--cpu-experts`).

When a layer's chosen ids reach the host, some of its misses have their records in host RAM (the
host tier). Copying one to the device costs record bytes / link speed; the CPU can instead compute
its (token, pick) pairs straight from those bytes with torch's int kernels
(moestream.kernels.cpu_experts), on a worker thread, while the device copies and computes the rest.
Those experts are not loaded: their slot table entries stay -1, and the CPU's weighted rows take
their pairs' places before the layer's per-token sum.

  - share: a float f in 0..1 gives the CPU floor(f * misses + 0.5) of the misses (at most those it
    can take); "auto" picks the number that makes both finish together, from an EMA of the CPU's
    GB/s and of the copy GB/s, and repacks (below) in the background the host-tier misses it gave
    to the device, one at a time, while the CPU is idle.
  - repacked weights: the first time the CPU computes an expert it repacks the record into the
    kernel's format (milliseconds: far more than computing it) and keeps it, keyed by (layer,
    expert), least recently used dropped first, at most `capacity_bytes` (about the record's bytes
    each: 4-bit in bf16 is the same size, 8-bit as two int4 halves ~1.06x, float32 scales more).
  - fail-closed: an error, or no result within `timeout_s`, hands the experts back to the caller,
    which loads them on the device and computes them there (counted as `cpu_fallbacks`). A worker
    still running after a timeout is left to finish; no layer gets a CPU share until it has.
  - layouts the CPU kernels cannot compute (activations other than SwiGLU, group sizes torch's
    kernel refuses, ...) are logged once and never given to the CPU.

Which experts the CPU computes depends on the cache and the timing, and its kernels round
differently from the device's, so with a CPU share the output is the reference's within the
dtype's tolerance, not bit for bit; `off` is never touched by any of this."""
from __future__ import annotations

import logging
import math
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Callable

import torch

from moestream.format.records import decode_record
from moestream.kernels.cpu_experts import compute_dtype, refusal, repack

log = logging.getLogger(__name__)
EMA = 0.25  # weight of the newest measurement in the speed averages
START_CPU_GB_S = 10.0  # first guesses for auto, until something has been measured
START_COPY_GB_S = 25.0
START_REPACK_S = 0.01


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
    compute_s: float = 0.0
    repacks: int = 0
    repack_s: float = 0.0
    skipped_busy: int = 0  # layers that got no share because the worker was still busy
    refused_layers: list = field(default_factory=list)


class CpuShare:
    def __init__(self, provider, layers, *, share: str | float, dtype: torch.dtype, timeout_s: float = 1.0,
                 capacity_bytes: int = 0):
        """provider: the ExpertCache (needs `holds`, `host_view`, `record_fields`, `quant`).
        layers: the MoE layer indices. capacity_bytes: the most repacked bytes kept."""
        if share == "off" or share is None:
            raise ValueError("CpuShare is for a share other than off")
        self.provider, self.share, self.timeout_s = provider, share, float(timeout_s)
        self.dtype = compute_dtype(dtype)
        self.capacity_bytes = capacity_bytes
        self.st = CpuShareStats()
        self.refused: dict[int, str | None] = {}
        self.record_bytes: dict[int, int] = {}
        for layer in layers:
            fields, quant = provider.record_fields(layer), provider.quant(layer)
            self.refused[layer] = refusal(fields, quant)
            self.record_bytes[layer] = sum(f.nbytes for f in fields)
            if self.refused[layer]:
                log.info("layer %d: no CPU share (%s)", layer, self.refused[layer])
                self.st.refused_layers.append(layer)
        self._repacked: OrderedDict = OrderedDict()  # (layer, expert) -> CpuExpert
        self._repacked_bytes = 0
        self._lock = threading.Lock()  # guards the repacked weights and the stats the worker updates
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moestream-cpu-experts")
        self._last: Future | None = None
        self.cpu_gb_s: float | None = None  # EMAs (auto)
        self.copy_gb_s: float | None = None
        self.repack_s_each: float | None = None
        self._copy_timings: list = []  # (start event, end event, bytes) not yet complete (CUDA)
        # fault injection for tests: jobs after the first `fault_after` fail; each job first sleeps fault_delay_s
        self.fault_after: int | None = None
        self.fault_delay_s: float = 0.0

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
        with self._lock:
            ready = [e for e in misses if (layer, e) in self._repacked]
        views, fresh = {}, []
        for e in misses:
            if e in ready:
                continue
            view = self.provider.host_view(layer, e)
            if view is not None:
                views[e] = view
                fresh.append(e)
        picked = self._pick(layer, len(misses), ready, fresh)
        for e in [e for e in fresh if e not in picked]:
            release = views.pop(e)[1]
            if release is not None:
                release()
        if not picked:
            if self.share == "auto" and views == {} and fresh:
                self._warm(layer, fresh[0])
            return None
        A = len(ids_host) // x.shape[0]
        chosen = set(picked)
        pairs = [p for p, e in enumerate(ids_host) if e in chosen]
        x_host, w_host = x.detach().to("cpu"), weights.detach().to("cpu", torch.float32)
        number = self.st.jobs
        self.st.jobs += 1
        future = self._executor.submit(self._compute, number, layer, picked, views, x_host, w_host,
                                       [ids_host[p] for p in pairs], [(p // A, p % A) for p in pairs])
        self._last = future
        return CpuJob(layer, picked, pairs, future, time.perf_counter())

    def _pick(self, layer: int, misses: int, ready: list[int], fresh: list[int]) -> list[int]:
        candidates = ready + fresh  # repacked first: they cost only the compute
        if self.share != "auto":
            return candidates[:min(len(candidates), math.floor(self.share * misses + 0.5))]
        self._collect_copy_timings()
        nbytes = self.record_bytes[layer]
        cpu_each = nbytes / ((self.cpu_gb_s or START_CPU_GB_S) * 1e9)
        copy_each = nbytes / ((self.copy_gb_s or START_COPY_GB_S) * 1e9)
        repack_each = self.repack_s_each or START_REPACK_S
        best, best_t, cpu_t = 0, misses * copy_each, 0.0
        for c, e in enumerate(candidates, start=1):
            cpu_t += cpu_each + (repack_each if e in fresh else 0.0)
            t = max(cpu_t, (misses - c) * copy_each)
            if t < best_t:
                best, best_t = c, t
        return candidates[:best]

    def _warm(self, layer: int, expert: int) -> None:
        """auto: repack one host-tier miss the device took, so that a later call may give it to the CPU."""
        with self._lock:
            if self._room_for(self.record_bytes[layer]) is False:
                return
        view = self.provider.host_view(layer, expert)
        if view is not None:
            self._last = self._executor.submit(self._repack_from, layer, expert, view)

    # -- the worker -------------------------------------------------------------------------------
    def _compute(self, number: int, layer: int, experts: list[int], views: dict, x: torch.Tensor, w: torch.Tensor,
                 pair_experts: list[int], pair_ta: list[tuple[int, int]]) -> torch.Tensor:
        try:
            if self.fault_delay_s:
                time.sleep(self.fault_delay_s)
            if self.fault_after is not None and number >= self.fault_after:
                raise RuntimeError(f"injected fault in CPU job {number}")
            weights = {}
            for e in experts:
                weights[e] = self._repacked_expert(layer, e, views.pop(e, None))
            t0 = time.perf_counter()
            rows = torch.empty((len(pair_ta), x.shape[1]), dtype=torch.float32)
            for i, (e, (t, a)) in enumerate(zip(pair_experts, pair_ta)):  # one pair at a time: bits never depend on T
                rows[i] = weights[e].ffn(x[t:t + 1])[0].float() * w[t, a]
            seconds = time.perf_counter() - t0
            with self._lock:
                self.st.compute_s += seconds
                nbytes = self.record_bytes[layer] * len(experts)
                if seconds > 0:
                    rate = nbytes / seconds / 1e9
                    self.cpu_gb_s = rate if self.cpu_gb_s is None else (1 - EMA) * self.cpu_gb_s + EMA * rate
            return rows
        finally:
            for _, release in views.values():
                if release is not None:
                    release()

    def _repack_from(self, layer: int, expert: int, view) -> None:
        self._repacked_expert(layer, expert, view)

    def _repacked_expert(self, layer: int, expert: int, view):
        """The kept repacked weights, or repack them from the pinned host record `view` (released here)."""
        key = (layer, expert)
        with self._lock:
            hit = self._repacked.get(key)
            if hit is not None:
                self._repacked.move_to_end(key)
        if hit is not None:
            if view is not None and view[1] is not None:
                view[1]()
            return hit
        if view is None:
            raise CpuShareFailed(f"layer {layer} expert {expert}: neither repacked nor in host RAM")
        record, release = view
        t0 = time.perf_counter()
        try:
            tensors = decode_record(self.provider.record_fields(layer), record)
            expert_weights = repack(tensors, self.provider.quant(layer), self.dtype)
        finally:
            if release is not None:
                release()
        seconds = time.perf_counter() - t0
        with self._lock:
            self.st.repacks += 1
            self.st.repack_s += seconds
            self.repack_s_each = seconds if self.repack_s_each is None else (1 - EMA) * self.repack_s_each + EMA * seconds
            if self._room_for(expert_weights.nbytes):
                self._repacked[key] = expert_weights
                self._repacked_bytes += expert_weights.nbytes
        return expert_weights

    def _room_for(self, nbytes: int) -> bool:
        """Drop least recently used repacked weights until nbytes fit; False if they never can."""
        if nbytes > self.capacity_bytes:
            return False
        while self._repacked_bytes + nbytes > self.capacity_bytes and self._repacked:
            _, old = self._repacked.popitem(last=False)
            self._repacked_bytes -= old.nbytes
        return True

    # -- joining ----------------------------------------------------------------------------------
    def wait(self, job: CpuJob) -> torch.Tensor:
        """The job's rows; CpuShareFailed (counted as fallbacks) on an error or after timeout_s."""
        left = max(0.0, self.timeout_s - (time.perf_counter() - job.started))
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
                "cpu_bytes": st.bytes, "cpu_compute_s": round(st.compute_s, 6),
                "cpu_gb_s": round(st.bytes / st.compute_s / 1e9, 3) if st.compute_s > 0 and st.bytes else None,
                "cpu_gb_s_ema": round(self.cpu_gb_s, 3) if self.cpu_gb_s else None,
                "copy_gb_s_ema": round(self.copy_gb_s, 3) if self.copy_gb_s else None,
                "cpu_repacks": st.repacks, "cpu_repack_s": round(st.repack_s, 6),
                "cpu_repacked_experts": held, "cpu_repacked_bytes": held_bytes,
                "cpu_skipped_busy": st.skipped_busy, "cpu_refused_layers": list(st.refused_layers)}

    def close(self) -> None:
        self._executor.shutdown(wait=True)
