"""One CPU job's experts computed in parallel, each expert on one core (moestream.kernels.cpu_experts).

A job is a layer call's CPU share: a few experts, each with the (token, pick) pairs that chose it.
Torch's int4 kernel spreads one product of one token (N 1536 or 2048, K 2048 or 768) over its
intra-op pool, which the products are too small for: on 16 cores the experts ran at 3.9 GB/s one
after another (docs/PERFORMANCE.md). Here every expert is a task for one of `threads` job threads,
each with one intra-op thread: the kernels release the interpreter's lock, so the threads compute
side by side (scripts/bench_cpu_experts.py measures how far that scales).

  - the same bits as one after another: a pair's row is computed by `CpuExpert.weighted_row_into`
    (one row at a time, the kernel's bits do not depend on its thread count) into its own output
    row; the per-token sums over the rows are the caller's, in its fixed order, so no result
    depends on which thread ran which expert or when;
  - an expert's pairs stay on one thread, one after another, so its weights are read by one core
    while they are in its cache; experts with the most pairs are taken first (a fairer finish);
  - the thread that calls `run` computes experts too: it is a job thread, and should have set
    its own intra-op threads to one (`enter`);
  - an error in any task is raised by `run` once every thread has stopped (the caller falls back).
"""
from __future__ import annotations

import os
import threading

import torch

# (a moestream.kernels.cpu_experts.CpuExpert, x row [1, H] in its compute dtype, float32 output row [H], weight)
Pair = tuple


def default_job_threads() -> int:
    """One job thread per core this process may use, less one for the thread that drives the
    engine (it waits for the device spinning, or computes on the CPU device)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores - 1)


def group_by_expert(pairs: list[Pair]) -> list[list[Pair]]:
    """The pairs grouped by expert (pairs in their order within a group), most pairs first, ties
    in the order of each expert's first pair."""
    groups: dict[int, list[Pair]] = {}
    for pair in pairs:
        groups.setdefault(id(pair[0]), []).append(pair)
    return sorted(groups.values(), key=len, reverse=True)  # stable: ties keep first-pair order


def run_group(group: list[Pair]) -> None:
    for expert, x, out, weight in group:
        expert.weighted_row_into(x, out, weight)


class ExpertJobs:
    def __init__(self, threads: int = 0):
        """threads: the job threads, the caller of `run` among them (0: `default_job_threads`)."""
        self.threads = max(1, threads or default_job_threads())
        self._run_lock = threading.Lock()  # one job at a time
        self._take_lock = threading.Lock()
        self._groups: list[list[Pair]] = []
        self._next = 0
        self._errors: list[BaseException] = []
        self._stop = False
        # per helper: released by `run` to start it, and by the helper when it has finished
        self._go = [threading.Lock() for _ in range(self.threads - 1)]
        self._done = [threading.Lock() for _ in range(self.threads - 1)]
        for lock in self._go + self._done:
            lock.acquire()
        caller_threads = torch.get_num_threads()
        started = threading.Barrier(self.threads)
        self._helpers = [threading.Thread(target=self._helper, args=(i, started), daemon=True,
                                          name=f"moestream-cpu-experts-{i + 1}") for i in range(self.threads - 1)]
        for t in self._helpers:
            t.start()
        started.wait()  # each helper has set its intra-op threads before anything else runs
        # a thread that never ran a parallel op takes the last count set anywhere: the caller's again
        torch.set_num_threads(caller_threads)

    @staticmethod
    def enter() -> None:
        """Called once on a thread that will call `run`: its products on one intra-op thread."""
        torch.set_num_threads(1)

    def run(self, pairs: list[Pair]) -> None:
        """Each pair's weighted row into its output row; returns when all are written."""
        if not pairs:
            return
        groups = group_by_expert(pairs)
        with self._run_lock:
            self._groups, self._next, self._errors = groups, 0, []
            helpers = min(len(groups), self.threads) - 1
            for i in range(helpers):
                self._go[i].release()
            self._work()
            for i in range(helpers):
                self._done[i].acquire()
            errors, self._groups = self._errors, []
        if errors:
            raise errors[0]

    def _take(self) -> list[Pair] | None:
        with self._take_lock:
            if self._next >= len(self._groups):
                return None
            self._next += 1
            return self._groups[self._next - 1]

    def _work(self) -> None:
        while (group := self._take()) is not None:
            try:
                run_group(group)
            except BaseException as exc:  # noqa: BLE001 - raised by `run` in the caller's thread
                self._errors.append(exc)

    def _helper(self, index: int, started: threading.Barrier) -> None:
        torch.set_num_threads(1)
        started.wait()
        go, done = self._go[index], self._done[index]
        with torch.inference_mode():  # as the callers' tensors were made
            while True:
                go.acquire()
                if self._stop:
                    return
                self._work()
                done.release()

    def close(self) -> None:
        """Stops the helpers (after the job running, if any)."""
        with self._run_lock:
            self._stop = True
            for go in self._go:
                go.release()
        for t in self._helpers:
            t.join(timeout=5)


__all__ = ["ExpertJobs", "default_job_threads", "group_by_expert"]
