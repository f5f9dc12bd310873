"""The CPU share's worker: a C++ thread (native/cpu_experts.cpp) serving the mailbox of
moestream.cpu_share.share. It polls the mailbox's sequence number in pinned RAM, computes the
withheld pairs with the native kernels straight from the host tier's records (no repack), writes
the rows and then the answer (its negative on an error), under the share's fail-closed rules (a
late answer carries an older number and is never taken). A Python worker measured slower (46.8
against 50.2 tok/s at 25 % on the H200: ~90 µs of hand-over per job under the interpreter).

Where the records are: the device-driven path needs a host tier holding every expert, filled before
the device map starts and never evicted after (moestream.experts.device_map), so a table of every
(layer, expert) record's host address is built once, here. What the ShareTuner needs comes back
through counters and a ring of per-job figures (job time in the worker, kernel time, bytes, experts,
the call's misses) that the share's Python side reads between jobs. Its team of threads spins
between a step's layers and is pinned to cores (native/team.h; an OpenMP region per job measured
slower)."""
from __future__ import annotations

import os
import weakref

import torch

from moestream.cpu_share import kernels
RING = 1024  # per-job figures kept for the retuning (it reads them every few milliseconds)
COUNTERS = ("jobs", "experts", "pairs", "errors", "skipped", "bytes", "kernel_ns", "job_ns", "ring")
RING_FIELDS = ("job_ns", "kernel_ns", "bytes", "experts", "misses", "layer")
RESERVED_CORES = 2  # the engine's thread (it launches and waits for the step) and one for the rest of the process


def team_size(threads: int) -> int:
    """The native worker's team (its poller computes as one of them): `threads`, but no more than the
    cores this process may use less RESERVED_CORES. A team member preempted by the engine's thread
    holds the whole job at its barrier: on the 16-core H200 machine a team of 15 computed 8.5 GB/s
    inside the step, one of 9 17.8, while alone there 15 compute 42-66."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    return max(1, min(int(threads), cores - RESERVED_CORES))


def record_tables(refused: dict[int, str | None], provider, device_map,
                  host_pool: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The layouts (int64 [layers, LAYOUT_LEN], zeros where the CPU takes no share) and the host addresses
    of every record (int64 [layers, experts]) of the device map's layers, from the host tier
    `host_pool` [R, B] (host memory) and the map's host slots."""
    layers = device_map.layers
    rows, cols = max(layers) + 1, max(device_map.num_experts.values())
    layouts = torch.zeros((rows, kernels.LAYOUT_LEN), dtype=torch.int64)
    addresses = torch.zeros((rows, cols), dtype=torch.int64)
    slots = device_map.host_slot.cpu()
    base, stride = host_pool.data_ptr(), host_pool.stride(0) * host_pool.element_size()
    for layer in layers:
        if refused.get(layer, "not an MoE layer"):
            continue
        layouts[layer] = kernels.layout(provider.record_fields(layer), provider.quant(layer))
        first, n = device_map.offset[layer], device_map.num_experts[layer]
        addresses[layer, :n] = base + slots[first:first + n] * stride
    return layouts, addresses


class NativeWorker:
    def __init__(self, box, layouts: torch.Tensor, addresses: torch.Tensor, *, threads: int, busy_s: float,
                 idle_sleep_s: float, host_pool: torch.Tensor):
        """box: the CpuShare whose mailbox tensors (header, x_in, ids_in, w_in, mask_in,
        rows_out, ack) the worker serves; host_pool: the host tier, kept alive with it."""
        module = kernels.load()
        self.counters = torch.zeros(len(COUNTERS), dtype=torch.int64)
        self.ring = torch.zeros((RING, len(RING_FIELDS)), dtype=torch.int64)
        self.control = torch.tensor([-1, 0], dtype=torch.int64)  # fault injection (tests): fail from job N, delay ns
        self._keep = (layouts, addresses, host_pool)
        # numpy views: read and written from any thread, in or out of inference mode
        self._counters, self._ring, self._control = self.counters.numpy(), self.ring.numpy(), self.control.numpy()
        self._read = 0  # ring entries taken so far
        self._worker = module.Worker(box.header, box.x_in, box.ids_in, box.w_in, box.mask_in, box.rows_out, box.ack,
                                     layouts, addresses, self.counters, self.ring, self.control, int(threads),
                                     int(busy_s * 1e9), int(idle_sleep_s * 1e9))
        self.threads = int(threads)
        asked = bool(layouts[:, kernels.INT8_ACTS].any()) if layouts.numel() else False
        self.activations = "int8" if asked and module.VNNI else "float"  # what its rows multiply the codes by
        self._worker.start()
        # stopped at close, or when this object goes, or at exit: never a thread left polling freed memory
        self._stop = weakref.finalize(self, self._worker.stop)

    def set_faults(self, fail_from: int | None, delay_s: float) -> None:
        self._control[0] = -1 if fail_from is None else int(fail_from)
        self._control[1] = int(delay_s * 1e9)

    def count(self) -> dict[str, int]:
        return dict(zip(COUNTERS, self._counters.tolist()))

    def new_jobs(self) -> list[dict[str, int]]:
        """The jobs answered since the last call, oldest first (the latest RING where more)."""
        written = int(self._counters[COUNTERS.index("ring")])
        start = max(self._read, written - RING)
        jobs = [dict(zip(RING_FIELDS, self._ring[i % RING].tolist())) for i in range(start, written)]
        self._read = written
        return jobs

    def pinned(self) -> bool:
        """Whether the team's members are pinned to cores (known once the worker has started)."""
        return self._worker.pinned()

    def last_error(self) -> str:
        return self._worker.last_error()

    def close(self) -> None:
        self._stop()
