"""Where expert records come from: O_DIRECT reads into host buffers, or the page cache via mmap.

Both sources serve whole records (one aligned read per miss) through one interface,
:class:`RecordSource`, and do their reads on a pool of I/O threads so that many misses are in
flight at once. ``direct`` bypasses the page cache, so the slot cache is the only copy and reads
cost exactly what the disk does; ``mmap`` lets the kernel's page cache be the host tier, with
``mincore`` saying what is already in RAM and ``madvise(WILLNEED)`` asking for early reads.

By default every record is checked against the crc32 the manifest holds for it, on the I/O
thread that read it, before anyone may use it: a damaged record is an ExpertReadError naming the
file, layer and expert, never a wrong answer. Checking costs about 8 us per 57 KB record and
0.36 ms per 2.6 MB record (7.5 GB/s on one core, docs/bench/crc32.json), against 66 us and 1.2 ms
for the O_DIRECT read itself.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import threading
import time
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Protocol, Sequence, runtime_checkable

import numpy as np
import torch

from moestream.errors import ExpertReadError, FormatError
from moestream.experts.buffers import PAGE_SIZE, aligned_buffer, is_page_aligned
from moestream.format.manifest import ExpertLayer
from moestream.format.reader import PackedModel

__all__ = ["SOURCE_KINDS", "DirectSource", "MmapSource", "RecordSource", "open_source"]

log = logging.getLogger(__name__)

SOURCE_KINDS = ("direct", "mmap")

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_no_direct_warned = False
_warn_lock = threading.Lock()


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

    def advise(self, layer: int, experts: Sequence[int]) -> None:
        """Ask for an early read of these records (a no-op for ``direct``)."""
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


def _fault_setting(value: int | None) -> int | None:
    """For fault tests: the read after the first `value` reads of a source fails once with EIO."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"fault_read_after must be a whole number of reads, not {value!r}")
    return value


class _Truncated(Exception):
    def __init__(self, file_end: int):
        self.file_end = file_end


class _SourceBase:
    """Validation, the I/O thread pool, checksums, fault injection and statistics."""

    name = "?"

    def __init__(self, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True,
                 fault_read_after: int | None = None):
        if io_threads < 1:
            raise ValueError(f"io_threads must be at least 1, not {io_threads}")
        self.directory = Path(packed.directory)
        self._entries: dict[int, ExpertLayer] = {e.layer: e for e in packed.manifest.expert_layers}
        self.check_records = check_records
        if check_records:
            for entry in self._entries.values():
                if len(entry.crc32) != entry.num_experts:
                    raise FormatError(f"{self.directory}: layer {entry.layer} has {len(entry.crc32)} record checksums "
                                      f"for {entry.num_experts} records, so records cannot be checked "
                                      "(--no-verify runs without the checks)")
        self._fault_after = _fault_setting(fault_read_after)
        self._lock = threading.Lock()
        self._attempts = 0
        self._counters = {"bytes_read": 0, "reads": 0, "read_s": 0.0, "errors": 0}
        self._closed = False
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix=f"moestream-{self.name}-io")

    # -- the interface -------------------------------------------------------
    def submit(self, layer: int, expert: int, dest: torch.Tensor) -> Future[None]:
        entry = self._check(layer, expert, dest)
        if self._closed:
            raise RuntimeError(f"the {self.name} expert source is closed")
        return self._pool.submit(self._read_record, entry, expert, dest)

    def read(self, layer: int, expert: int, dest: torch.Tensor) -> None:
        """Blocking read; the same as ``submit(...).result()`` but on the caller's thread."""
        entry = self._check(layer, expert, dest)
        if self._closed:
            raise RuntimeError(f"the {self.name} expert source is closed")
        self._read_record(entry, expert, dest)

    def resident(self, layer: int, experts: Sequence[int]) -> list[bool]:
        entry = self._entry(layer)
        for e in experts:
            self._check_expert(entry, e)
        return [False] * len(experts)

    def advise(self, layer: int, experts: Sequence[int]) -> None:
        pass

    def view(self, layer: int, expert: int) -> torch.Tensor | None:
        return None

    def stats(self) -> dict:
        with self._lock:
            return {"source": self.name, **self._counters, **self._extra_stats()}

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._pool.shutdown(wait=True)
        self._close_files()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- for subclasses ------------------------------------------------------
    def _read_into(self, entry: ExpertLayer, expert: int, dest: torch.Tensor) -> None:
        raise NotImplementedError

    def _close_files(self) -> None:
        pass

    def _extra_stats(self) -> dict:
        return {}

    # -- shared --------------------------------------------------------------
    def _entry(self, layer: int) -> ExpertLayer:
        entry = self._entries.get(layer)
        if entry is None:
            raise KeyError(f"layer {layer} has no routed experts")
        return entry

    @staticmethod
    def _check_expert(entry: ExpertLayer, expert: int) -> None:
        if not 0 <= expert < entry.num_experts:
            raise IndexError(f"layer {entry.layer} has {entry.num_experts} experts, not {expert}")

    def _check(self, layer: int, expert: int, dest: torch.Tensor) -> ExpertLayer:
        entry = self._entry(layer)
        self._check_expert(entry, expert)
        if (dest.dtype != torch.uint8 or dest.device.type != "cpu" or not dest.is_contiguous()
                or dest.numel() != entry.record_size):
            raise ValueError(f"a record of layer {layer} needs a contiguous uint8 CPU tensor of {entry.record_size} "
                             f"bytes, not {dest.dtype} {tuple(dest.shape)} on {dest.device}")
        return entry

    def _path(self, entry: ExpertLayer) -> Path:
        return self.directory / entry.file

    def _read_record(self, entry: ExpertLayer, expert: int, dest: torch.Tensor) -> None:
        where = f"layer {entry.layer} expert {expert}"
        start = time.perf_counter()
        try:
            self._inject_fault()
            self._read_into(entry, expert, dest)
            if self.check_records:
                crc = zlib.crc32(_bytes_of(dest))
                if crc != entry.crc32[expert]:
                    raise ExpertReadError(f"{self._path(entry)}: {where} is corrupt (crc32 {crc:08x}, the manifest "
                                          f"says {entry.crc32[expert]:08x}; `moestream verify` checks every file)")
        except _Truncated as exc:
            self._count(start, 0, failed=True)
            end = (expert + 1) * entry.record_size
            raise ExpertReadError(f"{self._path(entry)} is truncated: {where} ends at byte {end}, "
                                  f"but the file ends at byte {exc.file_end}") from None
        except OSError as exc:
            self._count(start, 0, failed=True)
            raise ExpertReadError(f"reading {where} from {self._path(entry)} failed: {exc}") from exc
        except BaseException:
            self._count(start, 0, failed=True)
            raise
        self._count(start, entry.record_size, failed=False)

    def _inject_fault(self) -> None:
        if self._fault_after is None:
            return
        with self._lock:
            attempt = self._attempts
            self._attempts += 1
        if attempt == self._fault_after:
            raise OSError(errno.EIO, f"{os.strerror(errno.EIO)} (injected after {self._fault_after} reads)")

    def _count(self, start: float, nbytes: int, *, failed: bool) -> None:
        elapsed = time.perf_counter() - start
        with self._lock:
            c = self._counters
            c["read_s"] += elapsed
            if failed:
                c["errors"] += 1
            else:
                c["reads"] += 1
                c["bytes_read"] += nbytes


def _bytes_of(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous uint8 CPU tensor, sharing its memory."""
    return memoryview(t.view(-1).numpy())


# -- direct: O_DIRECT preadv ------------------------------------------------------------------------


def _open_direct(path: Path) -> int:
    return os.open(path, os.O_RDONLY | _O_DIRECT)


def _open_buffered(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY)
    if hasattr(os, "posix_fadvise"):
        # whole-record random reads: the kernel's readahead would only read neighbours we may not want
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    return fd


def _pread(fd: int, buf: memoryview, offset: int) -> int:
    return os.preadv(fd, [buf], offset)


def _warn_no_direct(path: Path) -> None:
    global _no_direct_warned
    with _warn_lock:
        if _no_direct_warned:
            return
        _no_direct_warned = True
    log.warning("O_DIRECT not supported on %s; using buffered reads", path)


class _LayerFile:
    """One layer's file: the descriptor reads use now, and whether it bypasses the page cache."""

    def __init__(self, path: Path, fd: int, direct: bool):
        self.path = path
        self.fd = fd
        self.direct = direct
        self.confirmed = not direct  # a direct read has succeeded, so EINVAL is no longer "unsupported"
        self.fds = [fd]  # never closed before the source is: a racing reader may still use an old one
        self.buffered_fd: int | None = None if direct else fd
        self.lock = threading.Lock()

    def buffered(self) -> int:
        with self.lock:
            if self.buffered_fd is None:
                self.buffered_fd = _open_buffered(self.path)
                self.fds.append(self.buffered_fd)
            return self.buffered_fd

    def fall_back(self) -> None:
        fd = self.buffered()
        with self.lock:
            if self.direct:
                self.fd, self.direct, self.confirmed = fd, False, True
                _warn_no_direct(self.path.parent)


class DirectSource(_SourceBase):
    """Whole-record ``preadv`` with O_DIRECT from a thread pool; the page cache keeps no copy.

    Where a filesystem refuses O_DIRECT (EINVAL on open or on a file's first read) that file is
    read through the page cache instead, with one warning per process. A destination that is
    not page-aligned is read through a per-thread bounce buffer.
    """

    name = "direct"

    def __init__(self, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True,
                 fault_read_after: int | None = None, direct_io: bool = True):
        super().__init__(packed, io_threads=io_threads, check_records=check_records, fault_read_after=fault_read_after)
        self._local = threading.local()
        self._bounce_reads = 0
        self._files: dict[int, _LayerFile] = {}
        try:
            for layer, entry in self._entries.items():
                self._files[layer] = self._open(self._path(entry), direct_io and bool(_O_DIRECT))
        except OSError as exc:
            self._pool.shutdown(wait=False)
            self._close_files()
            raise ExpertReadError(f"cannot open {exc.filename or self.directory}: {exc.strerror}") from exc

    @staticmethod
    def _open(path: Path, direct: bool) -> _LayerFile:
        if direct:
            try:
                return _LayerFile(path, _open_direct(path), True)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                _warn_no_direct(path.parent)
        return _LayerFile(path, _open_buffered(path), False)

    def _bounce(self, nbytes: int) -> torch.Tensor:
        buf = getattr(self._local, "bounce", None)
        if buf is None or buf.numel() < nbytes:
            buf = self._local.bounce = aligned_buffer(nbytes)
        return buf[:nbytes]

    def _read_into(self, entry: ExpertLayer, expert: int, dest: torch.Tensor) -> None:
        f = self._files[entry.layer]
        size, offset = entry.record_size, expert * entry.record_size
        target = dest
        if f.direct and not is_page_aligned(dest):
            target = self._bounce(size)
            with self._lock:
                self._bounce_reads += 1
        buf = _bytes_of(target)
        fd, direct = f.fd, f.direct
        try:
            done = _pread(fd, buf, offset)
        except OSError as exc:
            if not (direct and exc.errno == errno.EINVAL and not f.confirmed):
                raise
            f.fall_back()
            done = _pread(f.fd, buf, offset)
        else:
            if direct and not f.confirmed:
                f.confirmed = True
        if done < size:
            # a short read: finish through the page cache, where any length and offset will do
            fd = f.buffered()
            while done < size:
                n = _pread(fd, buf[done:], offset + done)
                if n == 0:
                    raise _Truncated(offset + done)
                done += n
        if target is not dest:
            dest.view(-1).copy_(target)

    def _extra_stats(self) -> dict:
        return {"bounce_reads": self._bounce_reads,
                "buffered_files": sum(not f.direct for f in self._files.values())}

    def _close_files(self) -> None:
        for f in self._files.values():
            for fd in f.fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._files = {}


# -- mmap: the page cache as the host tier ------------------------------------------------------------


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


class MmapSource(_SourceBase):
    """Expert files mapped read-only: the kernel's page cache holds records, no copy of our own.

    ``submit`` copies from the mapping into ``dest`` on the I/O threads (the copy's page faults
    read from disk); ``view`` hands out the mapped record itself. The mapping must not shrink
    while in use: touching a page past the end of a file is a SIGBUS, so each read checks the
    file's size first and reports a truncated file instead.
    """

    name = "mmap"

    def __init__(self, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True,
                 fault_read_after: int | None = None):
        super().__init__(packed, io_threads=io_threads, check_records=check_records, fault_read_after=fault_read_after)
        self._maps: dict[int, _Mapping] = {}
        self._advised = 0
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
            raise _Truncated(available)
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
        """Whether every page of each record is in the page cache (``mincore``).

        The kernel answers for page-cache pages of files the process owns or may write; for
        others it reports only pages this process has touched, so the answer can err towards False.
        """
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

    def advise(self, layer: int, experts: Sequence[int]) -> None:
        """madvise(WILLNEED) on these records, one call per run of neighbouring records."""
        entry = self._entry(layer)
        for e in experts:
            self._check_expert(entry, e)
        m = self._maps.get(layer)
        if m is None:
            return
        runs: list[list[int]] = []
        for e in sorted(set(experts)):
            if runs and runs[-1][1] == e:
                runs[-1][1] = e + 1
            else:
                runs.append([e, e + 1])
        for first, end in runs:
            self._willneed(m, first * entry.record_size, end * entry.record_size)
        with self._lock:
            self._advised += len(set(experts))

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

    def _extra_stats(self) -> dict:
        return {"advised": self._advised}

    def _close_files(self) -> None:
        # The mappings are not closed: views handed out keep them alive and unmap them when dropped.
        for m in self._maps.values():
            try:
                os.close(m.fd)
            except OSError:
                pass
        self._maps = {}
