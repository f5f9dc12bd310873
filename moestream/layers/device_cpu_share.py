"""The CPU's share of the misses on the device-driven path (`--cpu-experts` with device-driven streaming).

On the device-driven path (moestream.experts.device_map) a streamed step is one CUDA graph and the
host never sees a layer's ids, so the host path's CPU share (moestream.layers.cpu_share: the host
reads the ids, hands some misses to a worker, waits) cannot run there. Here the device and a CPU
worker thread meet in a mailbox of pinned RAM instead, with no host launch or sync per layer:

  1. the device map withholds a share of the layer's misses (the first in expert order; a number
     in 1/1024ths that the device reads from pinned RAM, so the worker can retune it between
     layers): they get no slot and stay out of the layer's table;
  2. the device posts the layer's input rows, ids, weights and which pairs are withheld to the
     mailbox (stream-ordered copies into pinned RAM), then the sequence number, last;
  3. while the device copies its own misses and computes the hits and them, the worker, which
     polls the sequence number, computes the withheld pairs' weighted rows with the CPU kernels
     (moestream.kernels.cpu_experts, from the host tier repacked up front) and writes them back,
     then the sequence number as its answer (its negative on an error);
  4. a one-program kernel waits for that answer (moestream.kernels.triton_wait) up to a spin
     budget (~`cpu_experts_timeout`), and the rows come in where the answer is there;
  5. fail-closed: where it is not (error, late), the same graph loads the withheld experts and
     computes their pairs on the device (every kernel after the wait reads its flag), so the
     answer is the device's own, bit for bit.

The CPU rounds differently from the device kernels, so with a share the output is within the
dtype's tolerance of `off`, not bit for bit. Calls of more than MAX_PAIRS (token, expert) pairs
(prefill chunks) get no share. On the CPU device the same protocol runs with plain tensors and a
host-side wait (tests)."""
from __future__ import annotations

import logging
import threading
import time

import torch

log = logging.getLogger(__name__)

MAX_PAIRS = 64  # (token, expert) pairs of a call that can take a share: decode and short verify steps
SPINS_PER_SECOND = 1_000_000  # one poll of pinned RAM across PCIe takes about a microsecond
BUSY_S = 0.005  # the worker polls without sleeping for this long after its last job (a step's layers)
IDLE_SLEEP_S = 0.0002  # then it naps between polls (between requests)
START_COPY_GB_S = 40.0  # the device's own copy speed from the host tier until measured
EMA = 0.25


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


class DeviceCpuShare:
    def __init__(self, cpu, *, device: torch.device, hidden: int, max_tokens: int, dtype: torch.dtype,
                 timeout_s: float):
        """cpu: the moestream.layers.cpu_share.CpuShare holding the repacked experts, the share
        setting ("auto" or a float), the worker's thread count and the fault injection of tests."""
        self.cpu, self.device, self.dtype = cpu, torch.device(device), dtype
        self.cuda = self.device.type == "cuda"
        self.max_tokens, self.hidden = max_tokens, hidden
        self.timeout_s = float(timeout_s)
        self.max_spins = max(1, int(self.timeout_s * SPINS_PER_SECOND))
        pin = self.cuda
        # the mailbox, in pinned RAM: the device writes the request, the worker the answer
        self.header = _pinned(4, torch.int64, pin)  # sequence number, layer, tokens, pairs
        self.x_in = _pinned((max_tokens, hidden), torch.float32, pin)
        self.ids_in = _pinned(MAX_PAIRS, torch.int32, pin)
        self.w_in = _pinned(MAX_PAIRS, torch.float32, pin)
        self.mask_in = _pinned(MAX_PAIRS, torch.int8, pin)
        self.rows_out = _pinned((MAX_PAIRS, hidden), torch.float32, pin)
        self.ack = _pinned(1, torch.int64, pin)
        self.share = _pinned(1, torch.int32, pin)  # of each call's misses, in 1/1024ths
        # the device's side
        dev = self.device
        self.header_dev = torch.zeros(4, dtype=torch.int64, device=dev)
        self.rows = torch.zeros((MAX_PAIRS, hidden), dtype=torch.float32, device=dev)
        self.ok = torch.ones(1, dtype=torch.int32, device=dev)
        self.late = torch.zeros(1, dtype=torch.int64, device=dev)  # calls whose answer was missing
        self.lost = torch.zeros(1, dtype=torch.int64, device=dev)  # pairs the device computed instead
        self.ack_dev = _device_side(self.ack) if self.cuda else self.ack
        self.share_dev = _device_side(self.share) if self.cuda else self.share
        self.copy_gb_s = START_COPY_GB_S
        self.jobs = self.experts = self.pairs = self.errors = self.skipped = 0
        self.bytes = 0
        self.compute_s = 0.0
        self._mask: torch.Tensor | None = None
        self._set_share(0.5 if cpu.share == "auto" else float(cpu.share))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="moestream-cpu-experts-device", daemon=True)
        self._thread.start()

    # -- the device's side (inside the step's graph) ----------------------------------------------
    def takes(self, x: torch.Tensor, ids: torch.Tensor) -> bool:
        return ids.numel() <= MAX_PAIRS and x.shape[0] <= self.max_tokens

    def compute(self, experts, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """RoutedExperts.compute on the device-driven path with the CPU's share (see the module doc)."""
        dm, table = experts.device_map, experts.tables[layer]
        flat = ids.reshape(-1)
        dm.ensure(layer, ids, withhold=self.share_dev,
                  before_copy=lambda: self._post(layer, x, flat, weights, table))
        plan = experts.plan(layer, x, ids, weights, per_pair=True)
        pool = experts.provider.slot_pool(layer)
        plan.run_table(pool, table)  # the withheld pairs have no slot: skipped here
        self._take(layer, plan, flat, ids, table, dm, experts.num_experts[layer], pool)
        return plan.finish(residual, out=out) if out is not None else plan.finish(residual)

    def _post(self, layer: int, x: torch.Tensor, flat: torch.Tensor, weights: torch.Tensor,
              table: torch.Tensor) -> None:
        T, P = x.shape[0], flat.numel()
        self._mask = table[flat] < 0  # the withheld pairs (everything else has a slot now)
        h = self.header_dev
        h[0].add_(1)
        h[1].fill_(layer)
        h[2].fill_(T)
        h[3].fill_(P)
        self.x_in[:T].copy_(x.float(), non_blocking=True)
        self.ids_in[:P].copy_(flat.to(torch.int32), non_blocking=True)
        self.w_in[:P].copy_(weights.reshape(-1).float(), non_blocking=True)
        self.mask_in[:P].copy_(self._mask.to(torch.int8), non_blocking=True)
        self.header[1:].copy_(h[1:], non_blocking=True)
        self.header[:1].copy_(h[:1], non_blocking=True)  # the sequence number last: the worker starts on it

    def _take(self, layer: int, plan, flat: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, dm,
              num_experts: int, pool: torch.Tensor) -> None:
        P = flat.numel()
        if self.cuda:
            from moestream.kernels.triton_wait import wait_for_host

            wait_for_host(self.ack_dev, self.header_dev, self.ok, self.late, self.max_spins)
            self.rows[:P].copy_(self.rows_out[:P], non_blocking=True)
            plan.take_rows(self.rows, table)  # replaced below where the answer is missing
        else:  # the CPU device (tests): the host knows; on failure the whole layer again, in the plain order
            if self._wait_on_host():
                self.rows[:P].copy_(self.rows_out[:P])
                plan.take_rows(self.rows, table)
            else:
                self.lost.add_(self._mask.sum())
                dm.ensure(layer, ids, count=False)
                plan.out.zero_()
                plan.run_table(pool, table)
            return
        self._lose(flat, table, dm, layer, ids, num_experts, plan, pool)

    def _lose(self, flat, table, dm, layer, ids, num_experts, plan, pool) -> None:
        """Where the CPU's answer is missing (the flag says so, on the device): load the withheld
        experts and compute their pairs here (each pair's row is its own, summed later in the fixed
        order: the bits of no share). Runs in every call (a graph cannot branch), then costing a
        lookup with no misses and two kernels whose programs return at once."""
        lost = self._mask & (self.ok == 0)
        self.lost.add_(lost.sum())
        # a pair the device computed (its expert is held), gathered: indexing by a 0-d device tensor
        # would read it on the host, which a capture forbids
        filler = flat.gather(0, torch.argmin(self._mask.to(torch.int8)).view(1))
        dm.ensure(layer, torch.where(lost, flat, filler).view(ids.shape), count=False)
        redo = torch.zeros(num_experts, dtype=torch.int8, device=flat.device).scatter_(0, flat.to(torch.int64),
                                                                                          lost.to(torch.int8))
        plan.run_table(pool, torch.where(redo.bool(), table, torch.full_like(table, -1)))

    def _wait_on_host(self) -> bool:
        """The CPU device's wait (tests): poll the answer like the kernel does."""
        want = int(self.header_dev[0])
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

    # -- the worker -------------------------------------------------------------------------------
    @torch.inference_mode()  # the mailbox was made inside the engine's inference mode
    def _serve(self) -> None:
        torch.set_num_threads(self.cpu.threads)
        header, ack = self.header.numpy(), self.ack.numpy()
        done, idle = 0, time.perf_counter()
        while not self._stop.is_set():
            seq = int(header[0])
            if seq == done:
                time.sleep(0 if time.perf_counter() - idle < BUSY_S else IDLE_SLEEP_S)
                continue
            started = time.perf_counter()
            layer, tokens, pairs = (int(v) for v in header[1:4])
            x = self.x_in[:tokens].clone()
            ids = self.ids_in[:pairs].tolist()
            w = self.w_in[:pairs].clone()
            mask = self.mask_in[:pairs].tolist()
            if int(header[0]) != seq:  # the device moved on while this was read: that call is lost
                self.skipped += 1
                done = seq
                continue
            try:
                self._compute(layer, x, ids, w, mask, started)
                ack[0] = seq  # after the rows: x86 keeps stores in order
            except Exception as exc:  # noqa: BLE001 - the device computes them instead
                self.errors += 1
                log.warning("layer %d: CPU share failed (%s); the device computes those experts", layer, exc)
                ack[0] = -seq
            done, idle = seq, time.perf_counter()

    def _compute(self, layer: int, x: torch.Tensor, ids: list[int], w: torch.Tensor, mask: list[int],
                 started: float) -> None:
        cpu = self.cpu
        number = self.jobs
        self.jobs += 1
        if cpu.fault_delay_s:
            time.sleep(cpu.fault_delay_s)
        if cpu.fault_after is not None and number >= cpu.fault_after:
            raise RuntimeError(f"injected fault in CPU job {number}")
        mine = [p for p, m in enumerate(mask) if m]
        if not mine:
            return
        A = len(ids) // x.shape[0]
        xd = x.to(self.dtype)
        t0 = time.perf_counter()
        distinct = set()
        for p in mine:  # one pair at a time: bits never depend on T
            e = ids[p]
            weights = cpu._repacked.get((layer, e))
            if weights is None:
                raise RuntimeError(f"expert {e} is not repacked for the CPU")
            self.rows_out[p] = weights.ffn(xd[p // A:p // A + 1])[0].float() * w[p]
            distinct.add(e)
        done = time.perf_counter()
        self.compute_s += done - t0
        self.experts += len(distinct)
        self.pairs += len(mine)
        nbytes = cpu.record_bytes[layer] * len(distinct)
        self.bytes += nbytes
        if cpu.share == "auto":  # the job's whole latency, hand-over included: what the device waits for
            rate = nbytes / max(done - started, 1e-9) / 1e9
            cpu.cpu_gb_s = rate if cpu.cpu_gb_s is None else (1 - EMA) * cpu.cpu_gb_s + EMA * rate
            self._set_share(cpu.cpu_gb_s / (cpu.cpu_gb_s + self.copy_gb_s))

    def _set_share(self, share: float) -> None:
        self.share[0] = max(0, min(1024, int(round(share * 1024))))

    # -- reporting --------------------------------------------------------------------------------
    def stats(self) -> dict:
        """The host path's figures (the repack's among them) with this path's own in their place."""
        late, lost = int(self.late), int(self.lost)
        out = self.cpu.stats()
        out.update({"cpu_share_path": "device", "cpu_experts": self.experts, "cpu_pairs": self.pairs,
                    "cpu_fallbacks": lost, "cpu_late_calls": late, "cpu_timeouts": late - min(late, self.errors),
                    "cpu_errors": self.errors, "cpu_jobs": self.jobs, "cpu_bytes": self.bytes,
                    "cpu_compute_s": round(self.compute_s, 6),
                    "cpu_gb_s": round(self.bytes / self.compute_s / 1e9, 3) if self.compute_s > 0 and self.bytes else None,
                    "cpu_share_now": round(int(self.share[0]) / 1024, 4), "copy_gb_s": round(self.copy_gb_s, 3)})
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
