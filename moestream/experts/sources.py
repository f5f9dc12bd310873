"""Where expert records come from: O_DIRECT reads into host buffers, or the page cache via mmap.

Both sources serve whole records (one aligned read per miss) through one interface,
:class:`RecordSource`, and do their reads on a pool of I/O threads so that many misses are in
flight at once. ``direct`` bypasses the page cache, so the slot cache is the only copy and reads
cost exactly what the disk does; ``mmap`` lets the kernel's page cache be the host tier, with
``mincore`` saying what is already in RAM and ``madvise(WILLNEED)`` asking for early reads.

This module holds the interface and :func:`open_source`; the sources live in their own modules
(:mod:`~moestream.experts.direct_source`, :mod:`~moestream.experts.mmap_source`) on a shared
base, :mod:`~moestream.experts.source_base`, which also checks every record's crc32.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, Sequence, runtime_checkable

import torch

from moestream.experts.direct_source import DirectSource
from moestream.experts.mmap_source import MmapSource
from moestream.format.reader import PackedModel

__all__ = ["SOURCE_KINDS", "DirectSource", "MmapSource", "RecordSource", "open_source"]

SOURCE_KINDS = ("direct", "mmap")


@runtime_checkable
class RecordSource(Protocol):
    """Reads expert records; what the slot cache talks to."""

    name: str

    def submit(self, layer: int, expert: int, dest: torch.Tensor) -> Future[None]:
        """Start reading record (layer, expert) into ``dest`` (uint8, CPU, exactly record_size bytes).

        The future raises ExpertReadError naming the file, layer, expert and the OS error.
        """
        ...

    def read(self, layer: int, expert: int, dest: torch.Tensor) -> None: ...

    def resident(self, layer: int, experts: Sequence[int]) -> list[bool]:
        """Whether each record is already in host RAM (always False for ``direct``)."""
        ...

    def view(self, layer: int, expert: int) -> torch.Tensor | None:
        """A zero-copy, read-only uint8 tensor over the record, or None if the source has none."""
        ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def open_source(kind: str, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True,
                fault_read_after: int | None = None) -> RecordSource:
    """A record source of ``kind`` ("direct" or "mmap") over ``packed``'s expert files."""
    if kind == "direct":
        return DirectSource(packed, io_threads=io_threads, check_records=check_records,
                            fault_read_after=fault_read_after)
    if kind == "mmap":
        return MmapSource(packed, io_threads=io_threads, check_records=check_records,
                          fault_read_after=fault_read_after)
    raise ValueError(f"unknown expert source {kind!r} (choose from: {', '.join(SOURCE_KINDS)})")
