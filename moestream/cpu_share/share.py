"""The CPU's share of a streamed layer's misses (`--cpu-experts`), on the device-driven path.

On the device-driven path (moestream.experts.device_map) a streamed step is one CUDA graph and the
host never sees a layer's ids. The device and a CPU worker thread meet in a mailbox of pinned RAM,
with no host launch or sync per layer:

  1. the device map withholds a share of the layer's misses (the first in expert order; a number
     in 1/1024ths, or with `auto` a count for each number of misses, that the device reads from
     pinned RAM, so the share can be retuned between layers): they get no slot and stay out of the
     layer's table; the lookup writes how many it withheld into device memory;
  2. where it withheld any, the device posts the layer's input rows, ids, weights and which pairs
     are withheld to the mailbox, then the next sequence number, last (moestream.kernels.triton_mailbox);
  3. while the device copies its own misses and computes the hits and them, the worker
     (moestream.cpu_share.worker: a C++ thread, the native kernels straight from the host tier's
     records), which polls the sequence number, computes the withheld pairs' weighted rows and
     writes them back, then the sequence number as its answer (its negative on an error);
  4. a one-program kernel waits for that answer (moestream.kernels.triton_wait) up to a spin
     budget (~TIMEOUT_S), and the rows come in where the answer is there;
  5. fail-closed: where it is not (error, late), the same graph loads the withheld experts and
     computes their pairs on the device (every kernel after the wait reads its flag), so the
     answer is the device's own, bit for bit.

A call that withholds nothing (the share gives this layer no expert) posts nothing and takes no
sequence number, so the worker never sees it and a later call's number is the next one the worker
waits for; the wait returns at once without reading host memory, and the rows, the fallback's
lookup, copy and kernels are programs that read the count and return. An answer the device gave up
on (late) carries an older number than the one it waits for next, so it is never taken.

`auto`: a Python thread reads the worker's per-job figures every TUNE_EVERY_S and retunes the share
from each job's kernel time, its hand-over and the calls' misses against the device's copy speed,
timed once at start (moestream.cpu_share.tuning); every PROBE_EVERY-th lookup withholds at least one
miss, so a share at nothing is measured again.

The CPU rounds differently from the device kernels, so with a share the output is within the
dtype's tolerance of `off`, not bit for bit. Calls of more than MAX_PAIRS (token, expert) pairs
(prefill chunks) get no share. On the CPU device the same protocol runs with plain tensors and a
host-side wait (tests)."""
from __future__ import annotations

import logging
import math
import threading
import time
from dataclasses import dataclass

import torch

from moestream.cpu_share import kernels, worker
from moestream.cpu_share.tuning import ShareTuner

log = logging.getLogger(__name__)

MAX_PAIRS = 64  # (token, expert) pairs of a call that can take a share: decode and short verify steps
SPINS_PER_SECOND = 1_000_000  # one poll of pinned RAM across PCIe takes about a microsecond
BUSY_S = 0.005  # the worker polls without sleeping for this long after its last job (a step's layers)
IDLE_SLEEP_S = 0.0002  # then it naps between polls (between requests)
START_COPY_GB_S = 40.0  # the device's own copy speed from the host tier where it cannot be timed
PROBE_EVERY = 64  # auto: every this many lookups withhold at least one miss, so the CPU is timed again
COPY_TIMING_RECORDS = 6  # a layer's usual misses: the copy timed at start moves this many records
TUNE_EVERY_S = 0.002  # how often the worker's jobs' figures are read for `auto`
TIMEOUT_S = 1.0  # a layer waits this long for its CPU share, then computes those experts on the device


MAX_TOKENS = 16  # tokens of a call that can take a share (the mailbox's rows)


class ShareUnavailable(RuntimeError):
    """The CPU share cannot run here (the reason is the message)."""


@dataclass(frozen=True)
class ShareRequest:
    """What a RoutedExperts needs to start a CPU share with device-driven streaming: the share
    ("auto" or a float in 0..1), the compute threads, the hidden size and the compute dtype."""

    share: str | float
    threads: int
    hidden: int
    dtype: torch.dtype
    max_tokens: int = MAX_TOKENS


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


def refusals(provider, layers) -> dict[int, str | None]:
    """layer -> why the native kernels cannot compute its records (None where they can)."""
    return {layer: kernels.refusal(provider.record_fields(layer), provider.quant(layer)) for layer in layers}


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _pinned(shape, dtype: torch.dtype, cuda: bool) -> torch.Tensor:
    t = torch.zeros(shape, dtype=dtype)
    return t.pin_memory() if cuda else t


def _device_side(host: torch.Tensor) -> torch.Tensor:
    """The pinned `host` tensor as the GPU reads it (same memory: it sees the host's writes)."""
    from moestream.experts.uva import device_view

    view = device_view(host.view(torch.uint8).view(-1))
    if view is None:
        raise RuntimeError("this GPU cannot read pinned host memory at its address (no unified addressing)")
    return view.view(host.dtype).view(host.shape)


def time_copies(device_map, records: int = COPY_TIMING_RECORDS, rounds: int = 3) -> float | None:
    """The device's copy speed from the host tier in GB/s: `records` records gathered into a
    scratch buffer by the path's own copy (moestream.experts.device_map.copy_records), the fastest
    of `rounds` after one untimed round (its kernel compiled, the pages touched). None where the
    host tier has no records."""
    from moestream.experts.device_map import copy_records

    host, dev = device_map.host_pool, device_map.pool.device
    n = min(records, host.shape[0])
    if n == 0:
        return None
    scratch = torch.empty((n, host.shape[1]), dtype=torch.uint8, device=dev)
    idx = torch.arange(n, dtype=torch.int64, device=dev)
    todo = torch.ones(n, dtype=torch.int8, device=dev)
    best = None
    for r in range(rounds + 1):
        if dev.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            copy_records(host, scratch, idx, idx, todo)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1e3
        else:
            t0 = time.perf_counter()
            copy_records(host, scratch, idx, idx, todo)
            seconds = time.perf_counter() - t0
        if r and seconds > 0:
            best = seconds if best is None else min(best, seconds)
    return None if best is None else scratch.numel() / best / 1e9


class CpuShare:
    def __init__(self, provider, device_map, *, share: str | float, hidden: int, max_tokens: int,
                 dtype: torch.dtype, threads: int):
        """provider: the expert cache (record layouts, its host tier); device_map: the lookup that
        withholds the share (its copies `auto` times once); share: "auto" or a float in 0..1;
        threads: the compute threads (the worker's team: moestream.cpu_share.worker.team_size).
        Raises ShareUnavailable where the native kernels do not build or take no layer's records."""
        if kernels.load() is None:
            raise ShareUnavailable(f"no native CPU kernels ({kernels.reason()})")
        self.refused = refusals(provider, device_map.layers)
        for layer, why in self.refused.items():
            if why:
                log.info("layer %d: no CPU share (%s)", layer, why)
        if all(self.refused.values()):
            raise ShareUnavailable("the native CPU kernels take no layer's records")
        self.provider, self.share_setting = provider, share
        self.device = device_map.pool.device
        self.record_bytes = {layer: sum(f.nbytes for f in provider.record_fields(layer)) for layer in device_map.layers}
        self.cuda = self.device.type == "cuda"
        self.max_tokens, self.hidden = max_tokens, hidden
        self.timeout_s = TIMEOUT_S
        self.max_spins = max(1, int(self.timeout_s * SPINS_PER_SECOND))
        pin = self.cuda
        # the mailbox, in pinned RAM: the device writes the request, the worker the answer
        self.header = _pinned(5, torch.int64, pin)  # sequence number, layer, tokens, pairs, the call's misses
        x_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32  # what the worker reads
        self.x_in = _pinned((max_tokens, hidden), x_dtype, pin)
        self.ids_in = _pinned(MAX_PAIRS, torch.int32, pin)
        self.w_in = _pinned(MAX_PAIRS, torch.float32, pin)
        self.mask_in = _pinned(MAX_PAIRS, torch.int8, pin)
        self.rows_out = _pinned((MAX_PAIRS, hidden), torch.float32, pin)
        self.ack = _pinned(1, torch.int64, pin)
        # of each call's misses, in 1/1024ths; then every how many lookups at least one (auto's probe);
        # then (auto) how many of a call's m misses, m = 0..MAX_PAIRS, which the device reads instead
        self.share = _pinned(2 + MAX_PAIRS + 1, torch.int32, pin)
        # the device's side
        dev = self.device
        self.seq = torch.zeros(1, dtype=torch.int64, device=dev)  # the last sequence number posted
        self.withheld = torch.zeros(2, dtype=torch.int64, device=dev)  # this call's withheld misses, all its misses
        self.rows = torch.zeros((MAX_PAIRS, hidden), dtype=torch.float32, device=dev)
        self.ok = torch.ones(1, dtype=torch.int32, device=dev)
        self.late = torch.zeros(1, dtype=torch.int64, device=dev)  # calls whose answer was missing
        self.lost = torch.zeros(1, dtype=torch.int64, device=dev)  # pairs the device computed instead
        self.empty = torch.zeros(1, dtype=torch.int64, device=dev)  # calls that withheld nothing (posted nothing)
        self.ack_dev, self.share_dev = (_device_side(self.ack), _device_side(self.share)) if self.cuda else (self.ack, self.share)
        if share != "auto":  # a fixed share: the fraction alone
            self.share_dev = self.share_dev[:2]
        if self.cuda:  # the mailbox as the device's programs write and read it
            self.box_dev = {name: _device_side(getattr(self, name))
                            for name in ("header", "x_in", "ids_in", "w_in", "mask_in", "rows_out")}
        timed = time_copies(device_map) if share == "auto" else None
        self.copy_timed = timed is not None
        self.copy_gb_s = timed or START_COPY_GB_S
        self.tuner = ShareTuner(self.copy_gb_s)
        if share == "auto":
            self._apply_tuning()
        else:
            self._set_share(float(share))
        self.share[1] = PROBE_EVERY if share == "auto" else 0
        host_pool = provider.host.pool
        layouts, addresses = worker.record_tables(self.refused, provider, device_map, host_pool)
        team = worker.team_size(threads)
        self.native = worker.NativeWorker(self, layouts, addresses, threads=team, busy_s=BUSY_S,
                                          idle_sleep_s=IDLE_SLEEP_S, host_pool=host_pool)
        log.info("CPU share: the native worker on %d threads (of %d; %d cores kept for the engine), from the "
                 "host tier's records, %s activations", team, threads, worker.RESERVED_CORES, self.native.activations)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._tune, name="moestream-cpu-share-tuning", daemon=True)
        self._thread.start()

    def set_faults(self, fail_from: int | None, delay_s: float = 0.0) -> None:
        """Tests: jobs from number `fail_from` on fail; each job first sleeps `delay_s`."""
        self.native.set_faults(fail_from, delay_s)

    # -- the device's side (inside the step's graph) ----------------------------------------------
    def takes(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        return ids.numel() <= MAX_PAIRS and x.shape[0] <= self.max_tokens

    def compute(self, experts, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                split_x: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
        """RoutedExperts.compute on the device-driven path with the CPU's share (see the module doc)."""
        dm, table = experts.device_map, experts.tables[layer]
        flat = ids.reshape(-1).contiguous()
        w = weights.reshape(-1).contiguous()
        dm.ensure(layer, ids, withhold=self.share_dev, withheld=self.withheld,
                  before_copy=lambda: self._post(layer, x, flat, w, table))
        plan = experts.plan(layer, x, ids, weights, per_pair=True, split_x=split_x)
        pool = experts.provider.slot_pool(layer)
        plan.run_table(pool, table)  # the withheld pairs have no slot: skipped here
        if not self.cuda:
            self._take_on_host(layer, plan, flat, ids, table, dm, pool)
        elif hasattr(plan, "o"):  # the Triton plan: its per-pair rows, written by programs that read the flags
            self._take(layer, plan, flat, ids, table, dm, pool)
        else:
            self._take_torch(layer, plan, flat, ids, table, dm, experts.num_experts[layer], pool)
        return experts.finish_plan(plan, residual, out, norm)

    def _post(self, layer: int, x: torch.Tensor, flat: torch.Tensor, w: torch.Tensor, table: torch.Tensor) -> None:
        if self.cuda:
            from moestream.kernels import triton_mailbox

            box = self.box_dev
            triton_mailbox.post(self.withheld, self.seq, x, flat, w, table, layer, box["x_in"], box["ids_in"],
                                box["w_in"], box["mask_in"], box["header"])
            triton_mailbox.publish(self.withheld, self.seq, box["header"], self.empty)
            return
        # the CPU device (tests): the same request, the host deciding
        if int(self.withheld[0]) == 0:
            self.empty += 1
            return
        T, P = x.shape[0], flat.numel()
        self.x_in[:T].copy_(x)
        self.ids_in[:P].copy_(flat)
        self.w_in[:P].copy_(w)
        self.mask_in[:P].copy_(table[flat] < 0)
        self.header[1:].copy_(torch.tensor([layer, T, P, int(self.withheld[1])]))
        self.seq += 1
        self.header[0] = self.seq[0]  # the sequence number last: the worker starts on it

    def _take(self, layer: int, plan, flat: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, dm,
              pool: torch.Tensor) -> None:
        """After the hits: wait for the answer, take its rows, and where it is missing load the
        withheld experts and compute their pairs here (each pair's row is its own, summed later in
        the fixed order: the bits of no share). Every program reads the withheld count and the
        flag; with nothing withheld or the answer there, the fallback's lookup is gated off and its
        copy and kernels find nothing to do."""
        from moestream.kernels import triton_mailbox
        from moestream.kernels.triton_wait import wait_for_host

        P = flat.numel()
        wait_for_host(self.ack_dev, self.seq, self.ok, self.late, self.withheld, self.max_spins)
        triton_mailbox.take_rows(self.withheld, self.ok, flat, table, self.box_dev["rows_out"], plan.o)
        lookup = torch.empty_like(flat)
        lost = torch.empty(P, dtype=torch.int64, device=flat.device)
        gate = torch.empty(1, dtype=torch.int32, device=flat.device)
        triton_mailbox.lost_pairs(self.withheld, self.ok, flat, table, lookup, lost, gate, self.lost)
        dm.ensure(layer, lookup.view(ids.shape), count=False, gate=gate)
        redo = torch.empty_like(table)
        triton_mailbox.redo_table(gate, lost, table, redo)
        plan.run_table(pool, redo)

    def _take_torch(self, layer: int, plan, flat: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, dm,
                    num_experts: int, pool: torch.Tensor) -> None:
        """`_take` for a plan without per-pair rows (the torch reference on CUDA), in torch ops."""
        from moestream.kernels.triton_wait import wait_for_host

        P = flat.numel()
        mask = table[flat] < 0
        wait_for_host(self.ack_dev, self.seq, self.ok, self.late, self.withheld, self.max_spins)
        self.rows[:P].copy_(self.rows_out[:P], non_blocking=True)
        plan.take_rows(self.rows, table)  # replaced below where the answer is missing
        lost = mask & (self.ok == 0)
        self.lost.add_(lost.sum())
        # a pair the device computed (its expert is held), gathered: indexing by a 0-d device tensor
        # would read it on the host, which a capture forbids
        filler = flat.gather(0, torch.argmin(mask.to(torch.int8)).view(1))
        dm.ensure(layer, torch.where(lost, flat, filler).view(ids.shape), count=False)
        redo = torch.zeros(num_experts, dtype=torch.int8, device=flat.device).scatter_(0, flat.to(torch.int64),
                                                                                          lost.to(torch.int8))
        plan.run_table(pool, torch.where(redo.bool(), table, torch.full_like(table, -1)))

    def _take_on_host(self, layer: int, plan, flat: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, dm,
                      pool: torch.Tensor) -> None:
        """The CPU device (tests): the host knows; on failure the whole layer again, in the plain order."""
        P = flat.numel()
        if self._wait_on_host():
            if int(self.withheld[0]):
                self.rows[:P].copy_(self.rows_out[:P])
                plan.take_rows(self.rows, table)
            return
        self.lost.add_((table[flat] < 0).sum())
        dm.ensure(layer, ids, count=False)
        plan.out.zero_()
        plan.run_table(pool, table)

    def _wait_on_host(self) -> bool:
        """The CPU device's wait (tests): poll the answer like the kernel does (not at all where
        nothing was asked)."""
        if int(self.withheld[0]) == 0:
            self.ok.fill_(1)
            return True
        want = int(self.seq[0])
        deadline = time.perf_counter() + self.timeout_s
        while time.perf_counter() < deadline:
            got = int(self.ack[0])
            if got in (want, -want):
                break
            time.sleep(0)
        ok = int(self.ack[0]) == want
        self.ok.fill_(int(ok))
        if not ok:
            self.late += 1
        return ok

    # -- auto --------------------------------------------------------------------------------------
    @torch.inference_mode()  # the share's pinned tensors were made inside the engine's inference mode
    def _tune(self) -> None:
        """Every TUNE_EVERY_S, retune from the jobs the worker answered since (its ring of per-job
        figures) and log its new errors."""
        native, errors = self.native, 0
        while not self._stop.wait(TUNE_EVERY_S):
            jobs = native.new_jobs()
            if jobs and self.share_setting == "auto":  # every job into the averages, the share set once
                for job in jobs:
                    self.tuner.record(job_s=job["job_ns"] / 1e9, kernel_s=job["kernel_ns"] / 1e9, nbytes=job["bytes"],
                                      experts=job["experts"], misses=job["misses"])
                if self.tuner.measured:
                    self._apply_tuning()
            now = native.count()["errors"]
            if now > errors:
                log.warning("CPU share failed in %d job(s) (last: %s); the device computes those experts", now - errors,
                            native.last_error())
                errors = now

    def _apply_tuning(self) -> None:
        """auto: the tuner's counts per number of misses (and its share, for the stats)."""
        self._set_share(self.tuner.share(), self.tuner.counts(MAX_PAIRS))

    def _set_share(self, share: float, counts: list[int] | None = None) -> None:
        """The share the device reads: `share` of each call's misses, or (auto) `counts[m]` of a
        call's m misses (`share` then only reported)."""
        self.share[0] = max(0, min(1024, int(round(share * 1024))))
        if counts is not None:
            self.share[2:] = torch.tensor(counts, dtype=torch.int32)

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The share's figures for the receipt (the worker's counters, the device's fallbacks, auto's state)."""
        late, lost = int(self.late), int(self.lost)
        c = self.native.count()
        compute_s, nbytes, errors = c["kernel_ns"] / 1e9, c["bytes"], c["errors"]
        return {"cpu_share": self.share_setting, "cpu_worker_threads": self.native.threads,
                "cpu_worker_pinned": self.native.pinned(), "cpu_worker_activations": self.native.activations,
                "cpu_refused_layers": [layer for layer, why in self.refused.items() if why],
                "cpu_experts": c["experts"], "cpu_pairs": c["pairs"], "cpu_fallbacks": lost, "cpu_late_calls": late,
                "cpu_timeouts": late - min(late, errors), "cpu_errors": errors, "cpu_jobs": c["jobs"],
                "cpu_skipped_jobs": c["skipped"], "cpu_bytes": nbytes, "cpu_compute_s": round(compute_s, 6),
                "cpu_gb_s": round(nbytes / compute_s / 1e9, 3) if compute_s > 0 and nbytes else None,
                "cpu_empty_calls": int(self.empty), "cpu_share_now": round(int(self.share[0]) / 1024, 4),
                "cpu_counts_now": self.share[2:11].tolist() if self.share_setting == "auto" else None,
                "copy_gb_s": round(self.copy_gb_s, 3), "copy_gb_s_timed": self.copy_timed,
                "cpu_kernel_gb_s_ema": _round(self.tuner.kernel_gb_s, 3),
                "cpu_handover_us_ema": _round(self.tuner.handover_s and self.tuner.handover_s * 1e6, 1),
                "cpu_misses_per_job_ema": _round(self.tuner.misses, 2)}

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.native.close()
