"""Where expert records come from: O_DIRECT reads into host buffers (`direct`,
moestream.experts.direct_source), or the page cache via mmap (`mmap`, moestream.experts.mmap_source),
both on moestream.experts.source_base: whole records (one aligned read per miss) on a pool of I/O
threads, each record's crc32 checked. This module holds their interface and `open_source`."""
from __future__ import annotations

from concurrent.futures import Future
from typing import Protocol, Sequence, runtime_checkable

import torch

from moestream.experts.direct_source import DirectSource
from moestream.experts.mmap_source import MmapSource
from moestream.format.reader import PackedModel

SOURCES = {"direct": DirectSource, "mmap": MmapSource}


@runtime_checkable
class RecordSource(Protocol):
    """Reads expert records; what the slot cache talks to."""

    name: str

    def submit(self, layer: int, expert: int, dest: torch.Tensor) -> Future[None]:
        """Start reading record (layer, expert) into `dest` (uint8, CPU, exactly record_size bytes);
        the future raises ExpertReadError naming the file, layer, expert and the OS error."""
        ...

    def read(self, layer: int, expert: int, dest: torch.Tensor) -> None: ...

    def resident(self, layer: int, experts: Sequence[int]) -> list[bool]:
        """Whether each record is already in host RAM (always False for `direct`)."""
        ...

    def view(self, layer: int, expert: int) -> torch.Tensor | None:
        """A zero-copy, read-only uint8 tensor over the record, or None if the source has none."""
        ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


def open_source(kind: str, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True,
                fault_read_after: int | None = None) -> RecordSource:
    """A record source of `kind` ("direct" or "mmap") over `packed`'s expert files."""
    if kind not in SOURCES:
        raise ValueError(f"unknown expert source {kind!r} (choose from: {', '.join(SOURCES)})")
    return SOURCES[kind](packed, io_threads=io_threads, check_records=check_records, fault_read_after=fault_read_after)
