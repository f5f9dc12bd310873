"""The ``direct`` record source: whole-record O_DIRECT ``preadv`` that bypasses the page cache.

The slot cache is then the only copy, and reads cost exactly what the disk does. Where a
filesystem refuses O_DIRECT the source falls back to buffered reads, file by file.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
from pathlib import Path

import torch

from moestream.errors import ExpertReadError
from moestream.experts.buffers import aligned_buffer, is_page_aligned
from moestream.experts.source_base import RecordSource, Truncated, bytes_of
from moestream.format.manifest import ExpertLayer
from moestream.format.reader import PackedModel

log = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_no_direct_warned = False
_warn_lock = threading.Lock()


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


class DirectSource(RecordSource):
    """Whole-record ``preadv`` with O_DIRECT. Where a filesystem refuses O_DIRECT (EINVAL on open or on a
    file's first read) the file is read through the page cache, with one warning per process; an
    unaligned destination is read through a per-thread bounce buffer."""

    name = "direct"

    def __init__(self, packed: PackedModel, *, io_threads: int = 32, check_records: bool = True):
        super().__init__(packed, io_threads=io_threads, check_records=check_records)
        self._local = threading.local()
        self._bounce_reads = 0
        self._files: dict[int, _LayerFile] = {}
        try:
            for layer, entry in self._entries.items():
                self._files[layer] = self._open(self._path(entry), bool(_O_DIRECT))
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
        buf = bytes_of(target)
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
                    raise Truncated(offset + done)
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
