"""The ``mmap`` record source: the kernel's page cache as the host tier (files mapped read-only,
``mincore`` for what is in RAM, ``madvise(WILLNEED)`` for early reads).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import mmap
import os
import warnings
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from moestream.errors import ExpertReadError
from moestream.experts.buffers import PAGE_SIZE
from moestream.experts.source_base import RecordSource, Truncated
from moestream.format.manifest import ExpertLayer
from moestream.format.reader import PackedModel

log = logging.getLogger(__name__)


def _libc_mincore():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
    fn.restype = ctypes.c_int
    return fn


_mincore = _libc_mincore()


class _Mapping:
    """One layer's file mapped read-only, and a uint8 tensor over all of it."""

    def __init__(self, path: Path):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.mm: mmap.mmap | None = None
        self.tensor: torch.Tensor | None = None
        try:
            if os.fstat(self.fd).st_size > 0:
                self.mm = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
                if hasattr(mmap, "MADV_RANDOM"):
                    # Neighbouring records are unrelated experts: no read-around on faults. Reads
                    # ask for exactly their record with WILLNEED instead (see MmapSource._read_into).
                    self.mm.madvise(mmap.MADV_RANDOM)
                with warnings.catch_warnings():
                    # torch warns that the mapping is read-only; views of it are documented as such
                    warnings.simplefilter("ignore", UserWarning)
                    self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise

    @property
    def length(self) -> int:
        return 0 if self.tensor is None else self.tensor.numel()


class MmapSource(RecordSource):
    """Expert files mapped read-only: ``submit`` copies from the mapping on the I/O threads (its page
    faults read the disk), ``view`` hands out the mapped record. A page past a file's end is a
    SIGBUS, so each read checks the file's size first and reports a truncated file instead."""

    name = "mmap"

    def __init__(self, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True):
        super().__init__(packed, io_threads=io_threads, check_records=check_records)
        self._maps: dict[int, _Mapping] = {}
        self._warned_mincore = False
        try:
            for layer, entry in self._entries.items():
                self._maps[layer] = _Mapping(self._path(entry))
        except (OSError, ValueError) as exc:
            self._pool.shutdown(wait=False)
            self._close_files()
            raise ExpertReadError(f"cannot map the expert files in {self.directory}: {exc}") from exc

    def _span(self, layer: int, expert: int) -> tuple[_Mapping, int, int]:
        entry = self._entry(layer)
        self._check_expert(entry, expert)
        m = self._maps.get(layer)
        if m is None:
            raise RuntimeError("the mmap expert source is closed")
        return m, expert * entry.record_size, entry.record_size

    def _read_into(self, entry: ExpertLayer, expert: int, dest: torch.Tensor) -> None:
        m, offset, size = self._span(entry.layer, expert)
        available = min(m.length, os.fstat(m.fd).st_size)
        if offset + size > available:
            raise Truncated(available)
        # one readahead request for the whole record, rather than a page fault per page
        self._willneed(m, offset, offset + size)
        # ctypes calls drop the GIL, so page faults on one I/O thread never hold up the others
        ctypes.memmove(dest.data_ptr(), m.tensor.data_ptr() + offset, size)

    def view(self, layer: int, expert: int) -> torch.Tensor | None:
        """The mapped record, zero-copy and read-only (writing to it faults); None past the file's end,
        and always None while records are checked: a mapped record would reach its user unchecked, so
        it goes through ``submit`` (copy and crc32 on an I/O thread) instead."""
        if self.check_records:
            return None
        m, offset, size = self._span(layer, expert)
        if offset + size > min(m.length, os.fstat(m.fd).st_size):
            return None
        return m.tensor[offset:offset + size]

    def resident(self, layer: int, experts: Sequence[int]) -> list[bool]:
        """Whether every page of each record is in the page cache (``mincore``; for files this process may
        not write it reports only pages it touched, so it can err towards False)."""
        out = []
        for e in experts:
            m, offset, size = self._span(layer, e)
            out.append(offset + size <= m.length and self._in_core(m.tensor.data_ptr() + offset, size))
        return out

    def _in_core(self, address: int, size: int) -> bool:
        if _mincore is None:
            return False
        start = address - address % PAGE_SIZE
        length = size + (address - start)
        vec = (ctypes.c_ubyte * (-(-length // PAGE_SIZE)))()
        if _mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
            if not self._warned_mincore:
                self._warned_mincore = True
                log.warning("mincore failed (%s); treating records as not resident", os.strerror(ctypes.get_errno()))
            return False
        return bool((np.frombuffer(vec, dtype=np.uint8) & 1).all())

    @staticmethod
    def _willneed(m: _Mapping, start: int, stop: int) -> None:
        if m.mm is None or not hasattr(mmap, "MADV_WILLNEED"):
            return
        stop = min(stop, m.length)
        aligned = start - start % mmap.PAGESIZE
        if stop <= aligned:
            return
        try:
            m.mm.madvise(mmap.MADV_WILLNEED, aligned, stop - aligned)
        except (OSError, ValueError) as exc:  # a hint: failing costs speed, never correctness
            log.debug("madvise(WILLNEED) on %s failed: %s", m.path, exc)

    def _close_files(self) -> None:
        # The mappings are not closed: views handed out keep them alive and unmap them when dropped.
        for m in self._maps.values():
            try:
                os.close(m.fd)
            except OSError:
                pass
        self._maps = {}
