"""A timeline of one run as Chrome trace events (chrome://tracing, ui.perfetto.dev): the host's
steps, prefill chunks, expert loads, waits, reads and copies and, on CUDA, the device's segments.

Off by default, every hook then returns a shared do-nothing context (hooks may sit in hot paths).
`recording(path)` turns it on for a block. Host spans are perf_counter times of their thread; device
spans are CUDA event pairs, read at the end and placed on the host clock by an event at the start.
"""
from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from pathlib import Path
from typing import Any, Iterator

_NULL = contextlib.nullcontext()
_recorder: "Timeline | None" = None
DEVICE_TID = 0  # the device's track (real thread ids are never 0)


def enabled() -> bool:
    return _recorder is not None


def span(name: str, **args: Any):
    """A host span around a block: `with timeline.span("load", layer=3): ...`."""
    recorder = _recorder
    return _NULL if recorder is None else recorder.host_span(name, args)


def segment(key: tuple):
    """A device segment, named by the decoder's segment key ("attention", layer, token) etc.: a
    host span of its launch (its whole run on the CPU) and, on CUDA, its run on the device."""
    recorder = _recorder
    return _NULL if recorder is None else recorder.device_span(key)


def complete(name: str, start_s: float, end_s: float, **args: Any) -> None:
    """A host span already timed by the caller with time.perf_counter()."""
    recorder = _recorder
    if recorder is not None:
        recorder.add(name, start_s, end_s, args)


def instant(name: str, **args: Any) -> None:
    """A point in time on the calling thread (a read or copy started)."""
    recorder = _recorder
    if recorder is not None:
        recorder.point(name, args)


class Timeline:
    def __init__(self, *, cuda_device: Any = None) -> None:
        self.pid = os.getpid()
        self.t0 = time.perf_counter()
        self.events: list[dict] = []
        self.threads: dict[int, str] = {}
        self._lock = threading.Lock()  # reader threads add events too
        self._device: list[tuple[str, dict, Any, Any]] = []
        self._cuda = cuda_device
        self._base = None
        if cuda_device is not None:
            import torch

            torch.cuda.synchronize(cuda_device)
            self._base = torch.cuda.Event(enable_timing=True)
            self._base.record()
            self._base_s = time.perf_counter()

    def _us(self, t: float) -> float:
        return round((t - self.t0) * 1e6, 3)

    def _tid(self) -> int:
        tid = threading.get_native_id()
        if tid not in self.threads:
            self.threads[tid] = threading.current_thread().name
        return tid

    def add(self, name: str, start_s: float, end_s: float, args: dict, *, cat: str = "host") -> None:
        self._append({"name": name, "cat": cat, "ph": "X", "ts": self._us(start_s),
                      "dur": round(max(0.0, end_s - start_s) * 1e6, 3), "pid": self.pid, "args": args})

    def point(self, name: str, args: dict) -> None:
        self._append({"name": name, "cat": "host", "ph": "i", "s": "t", "ts": self._us(time.perf_counter()),
                      "pid": self.pid, "args": args})

    def _append(self, event: dict) -> None:
        with self._lock:
            event["tid"] = self._tid()
            self.events.append(event)

    @contextlib.contextmanager
    def host_span(self, name: str, args: dict) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.add(name, start, time.perf_counter(), args)

    @contextlib.contextmanager
    def device_span(self, key: tuple) -> Iterator[None]:
        name, args = segment_name(key)
        start = time.perf_counter()
        events = None
        if self._cuda is not None:
            import torch

            events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            events[0].record()
        try:
            yield
        finally:
            if events is not None:
                events[1].record()
                with self._lock:
                    self._device.append((name, args, *events))
            self.add(name, start, time.perf_counter(), args, cat="launch" if events is not None else "compute")

    def trace(self) -> dict:
        """The trace-event JSON object (device spans resolved: this waits for the device)."""
        events = list(self.events)
        if self._device:
            import torch

            torch.cuda.synchronize(self._cuda)
            for name, args, begin, end in self._device:
                start_s = self._base_s + self._base.elapsed_time(begin) / 1e3
                events.append({"name": name, "cat": "device", "ph": "X", "ts": self._us(start_s),
                               "dur": round(begin.elapsed_time(end) * 1e3, 3), "pid": self.pid, "tid": DEVICE_TID,
                               "args": args})
        names = dict(self.threads)
        if self._device:
            names[DEVICE_TID] = f"device ({self._cuda})"
        meta = [{"name": "process_name", "ph": "M", "pid": self.pid, "args": {"name": "moestream"}}]
        meta += [{"name": "thread_name", "ph": "M", "pid": self.pid, "tid": tid, "args": {"name": n}}
                 for tid, n in names.items()]
        return {"traceEvents": meta + sorted(events, key=lambda e: e["ts"]), "displayTimeUnit": "ms"}


def segment_name(key: tuple) -> tuple[str, dict]:
    """("attention-rows", 3, T) -> ("attention", {"layer": 3, "tokens": T}) (a step's rows at once);
    ("experts", 3, T) -> ("experts", {"layer": 3, "tokens": T}); ("head"[, T]) (CUDA: all rows at once);
    ("start", T); ("step", T)."""
    kind, rest = str(key[0]), key[1:]
    if kind == "attention-rows" and len(rest) == 2:
        return "attention", {"layer": rest[0], "tokens": rest[1]}
    if kind == "experts" and len(rest) == 2:
        return kind, {"layer": rest[0], "tokens": rest[1]}
    return kind, {"tokens": rest[0]} if rest else {}


@contextlib.contextmanager
def recording(path: str | Path | None, *, device: Any = None) -> Iterator[Timeline | None]:
    """Record the block's timeline and write it to `path` (nothing when path is None). `device`:
    the engine's torch device; a CUDA one adds the device track."""
    global _recorder
    if path is None:
        yield None
        return
    if _recorder is not None:
        raise RuntimeError("a timeline is already being recorded")
    cuda = device if device is not None and getattr(device, "type", "") == "cuda" else None
    recorder = Timeline(cuda_device=cuda)
    _recorder = recorder
    try:
        yield recorder
    finally:
        _recorder = None
        Path(path).write_text(json.dumps(recorder.trace()))
