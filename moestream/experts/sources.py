"""Where expert records come from: O_DIRECT reads into host buffers (`direct`,
moestream.experts.direct_source), or the page cache via mmap (`mmap`, moestream.experts.mmap_source),
both RecordSources (moestream.experts.source_base): whole records (one aligned read per miss) on a
pool of I/O threads, each record's crc32 checked."""
from __future__ import annotations

from moestream.experts.direct_source import DirectSource
from moestream.experts.mmap_source import MmapSource
from moestream.experts.source_base import RecordSource
from moestream.format.reader import PackedModel

SOURCES = {"direct": DirectSource, "mmap": MmapSource}


def open_source(kind: str, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True) -> RecordSource:
    """A record source of `kind` ("direct" or "mmap") over `packed`'s expert files."""
    if kind not in SOURCES:
        raise ValueError(f"unknown expert source {kind!r} (choose from: {', '.join(SOURCES)})")
    return SOURCES[kind](packed, io_threads=io_threads, check_records=check_records)
