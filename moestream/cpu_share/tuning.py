"""How large the CPU's share of a layer's misses should be on the device-driven path (`--cpu-experts auto`).

A layer call's m misses split: c experts to the CPU, m - c copied by the device. The CPU's side
takes a fixed hand-over h (the request posted, the worker noticing and reading it, Python, the answer
back) plus c times its kernels' time per expert k; the device's side (m - c) times its copy time per
expert d. A call with c = 0 posts nothing and pays no hand-over. The best c minimizes
max(h + c k, (m - c) d); the device reads it for every m (`counts`: a call's own misses pick its
count, where one share of the calls' usual m rounded 5 misses like 6 and 7 like 8), and `share`,
c / m for the usual m, is what the stats report.

What is measured, and how:
  - k: the kernels' own time in each job, per byte of the records it computed (an EMA);
  - h: each job's latency in the worker less its kernels (an EMA), plus `link_s`, the part the
    worker cannot see (the device's post and its wait noticing the answer: PCIe round trips);
  - m: the misses of the calls that posted a job (an EMA);
  - d: the device's copy speed, timed once at start (moestream.cpu_share.share), since the
    copies run inside the step's CUDA graph where nothing times them; assumed where not timed.
The first `warm_jobs` jobs are left out of every average (thread pools starting, pages touched for
the first time: they measured 0.72 GB/s on the H200 machine where the kernels do 40).

Pure Python (no torch), so the retuning is unit-tested with made-up timings."""
from __future__ import annotations

from dataclasses import dataclass

EMA = 0.25  # weight of the newest job in the averages
WARM_JOBS = 2  # jobs left out of the averages
LINK_S = 10e-6  # the hand-over's part outside the worker (post, the wait's poll, the rows back): assumed
START_SHARE = 0.5  # until a job has been measured
START_MISSES = 4.0


def best_count(misses: int, cpu_each_s: float, handover_s: float, copy_each_s: float) -> int:
    """The number of a call's `misses` the CPU should take: the smallest c minimizing
    max(handover + c * cpu_each, (misses - c) * copy_each), c = 0 costing no hand-over."""
    best, best_t = 0, misses * copy_each_s
    for c in range(1, misses + 1):
        t = max(handover_s + c * cpu_each_s, (misses - c) * copy_each_s)
        if t < best_t:
            best, best_t = c, t
    return best


@dataclass
class ShareTuner:
    copy_gb_s: float  # the device's copy speed from the host tier
    warm_jobs: int = WARM_JOBS
    link_s: float = LINK_S
    ema: float = EMA
    jobs: int = 0  # every job seen, the warm ones too
    kernel_s_per_byte: float | None = None
    worker_s: float | None = None  # a job's latency in the worker beyond its kernels
    bytes_per_expert: float | None = None
    misses: float | None = None  # a posting call's misses

    def record(self, *, job_s: float, kernel_s: float, nbytes: int, experts: int, misses: int) -> None:
        """One job: its latency in the worker, its kernels' time, the bytes of the experts it
        computed (`experts` of them) and the misses of the call it came from."""
        self.jobs += 1
        if self.jobs <= self.warm_jobs or experts <= 0 or nbytes <= 0:
            return
        self.kernel_s_per_byte = self._avg(self.kernel_s_per_byte, kernel_s / nbytes)
        self.worker_s = self._avg(self.worker_s, max(0.0, job_s - kernel_s))
        self.bytes_per_expert = self._avg(self.bytes_per_expert, nbytes / experts)
        self.misses = self._avg(self.misses, float(max(misses, experts)))

    def _avg(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.ema) * old + self.ema * new

    @property
    def measured(self) -> bool:
        return self.kernel_s_per_byte is not None

    @property
    def handover_s(self) -> float | None:
        return None if self.worker_s is None else self.worker_s + self.link_s

    @property
    def kernel_gb_s(self) -> float | None:
        return None if not self.kernel_s_per_byte else 1 / self.kernel_s_per_byte / 1e9

    def counts(self, most: int) -> list[int]:
        """How many of a call's m misses the CPU takes, for m = 0..most."""
        if not self.measured:
            return [int(START_SHARE * m + 0.5) for m in range(most + 1)]
        nbytes = self.bytes_per_expert
        cpu_each, copy_each = self.kernel_s_per_byte * nbytes, nbytes / (self.copy_gb_s * 1e9)
        return [best_count(m, cpu_each, self.handover_s, copy_each) for m in range(most + 1)]

    def share(self) -> float:
        """The share of each call's misses for the device (0..1)."""
        if not self.measured:
            return START_SHARE
        m = max(1, round(self.misses if self.misses is not None else START_MISSES))
        nbytes = self.bytes_per_expert
        c = best_count(m, self.kernel_s_per_byte * nbytes, self.handover_s, nbytes / (self.copy_gb_s * 1e9))
        return c / m
