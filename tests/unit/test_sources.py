"""Record sources (O_DIRECT reads and the mmap page cache) and the aligned host buffers they read into."""
from __future__ import annotations

import errno
import logging
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch

from moestream.errors import ExpertReadError, FormatError
from moestream.experts import direct_source
from moestream.experts.buffers import PAGE_SIZE, aligned_buffer, is_page_aligned, pin_if_cuda
from moestream.experts.sources import RecordSource, open_source
from moestream.format.reader import PackedModel

KINDS = ("direct", "mmap")
LOGGER = "moestream.experts.direct_source"


@pytest.fixture(scope="module")
def model_dir(tiny_packed_model) -> Path:
    return tiny_packed_model("qwen3_moe", "q4")


@pytest.fixture
def copy_dir(model_dir, tmp_path) -> Path:
    """A private copy of the model that a test may damage."""
    out = tmp_path / "model"
    shutil.copytree(model_dir, out)
    return out


def all_records(packed: PackedModel) -> list[tuple[int, int]]:
    return [(e.layer, x) for e in packed.manifest.expert_layers for x in range(e.num_experts)]


def record_size(packed: PackedModel, layer: int) -> int:
    return packed.expert_layer(layer).record_size


def fail_once_after(source, reads: int) -> None:
    """The source's read after its first `reads` reads fails once with EIO (a disk error)."""
    read_into, attempts, lock = source._read_into, [0], threading.Lock()

    def faulty(entry, expert, dest):
        with lock:
            attempt = attempts[0]
            attempts[0] += 1
        if attempt == reads:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        read_into(entry, expert, dest)

    source._read_into = faulty


def read_one(source, packed, layer, expert) -> bytes:
    dest = aligned_buffer(record_size(packed, layer))
    source.submit(layer, expert, dest).result(timeout=30)
    return dest.numpy().tobytes()


# -- buffers ----------------------------------------------------------------------------------------


def test_aligned_buffer_is_page_aligned_zeroed_and_outlives_its_base():
    buf = aligned_buffer(3 * PAGE_SIZE + 5)
    assert buf.dtype == torch.uint8 and buf.numel() == 3 * PAGE_SIZE + 5 and is_page_aligned(buf)
    assert int(buf.sum()) == 0
    rows = aligned_buffer(4 * 8192).view(4, 8192)  # the base tensor is dropped at once
    rows[3].fill_(7)
    assert is_page_aligned(rows[1]) and int(rows[3].sum()) == 7 * 8192
    with pytest.raises(ValueError):
        aligned_buffer(0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_pin_if_cuda_is_a_no_op_without_cuda():
    buf = aligned_buffer(PAGE_SIZE)
    assert pin_if_cuda(buf) is buf


# -- the interface ---------------------------------------------------------------------------------


def test_open_source_names_the_choices(model_dir):
    with pytest.raises(ValueError, match="direct, mmap"):
        open_source("nvme", PackedModel(model_dir))


@pytest.mark.parametrize("kind", KINDS)
def test_every_record_equals_the_packed_model_record(model_dir, kind):
    packed = PackedModel(model_dir)
    with open_source(kind, packed, io_threads=4) as source:
        assert isinstance(source, RecordSource) and source.name == kind
        for layer, expert in all_records(packed):
            assert read_one(source, packed, layer, expert) == packed.read_record(layer, expert)
            blocking = aligned_buffer(record_size(packed, layer))
            source.read(layer, expert, blocking)
            assert blocking.numpy().tobytes() == packed.read_record(layer, expert)
        stats = source.stats()
    n = len(all_records(packed))
    assert stats["reads"] == 2 * n and stats["errors"] == 0 and stats["read_s"] >= 0
    assert stats["bytes_read"] == 2 * sum(record_size(packed, layer) for layer, _ in all_records(packed))


@pytest.mark.parametrize("kind", KINDS)
def test_many_concurrent_submits_into_one_pool(model_dir, kind):
    packed = PackedModel(model_dir)
    keys = all_records(packed) * 6
    size = max(record_size(packed, layer) for layer, _ in keys)
    pool = aligned_buffer(len(keys) * size).view(len(keys), size)
    with open_source(kind, packed, io_threads=16) as source:
        futures = [source.submit(layer, expert, pool[i][:record_size(packed, layer)])
                   for i, (layer, expert) in enumerate(keys)]
        for f in futures:
            assert f.result(timeout=30) is None
        assert source.stats()["reads"] == len(keys)
    for i, (layer, expert) in enumerate(keys):
        assert pool[i][:record_size(packed, layer)].numpy().tobytes() == packed.read_record(layer, expert)


@pytest.mark.parametrize("kind", KINDS)
def test_unaligned_destination_reads_correctly(model_dir, kind):
    packed = PackedModel(model_dir)
    layer, expert = all_records(packed)[3]
    size = record_size(packed, layer)
    dest = aligned_buffer(size + 64)[64:]
    assert not is_page_aligned(dest)
    with open_source(kind, packed, io_threads=2) as source:
        source.read(layer, expert, dest)
        stats = source.stats()
    assert dest.numpy().tobytes() == packed.read_record(layer, expert)
    if kind == "direct" and stats["buffered_files"] == 0:
        assert stats["bounce_reads"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_bad_arguments_fail_at_once(model_dir, kind):
    packed = PackedModel(model_dir)
    layer = packed.manifest.expert_layers[0].layer
    size = record_size(packed, layer)
    with open_source(kind, packed, io_threads=2) as source:
        with pytest.raises(ValueError, match=f"{size} bytes"):
            source.submit(layer, 0, aligned_buffer(size - 1))
        with pytest.raises(ValueError):
            source.submit(layer, 0, torch.zeros(size, dtype=torch.float32))
        with pytest.raises(IndexError):
            source.submit(layer, 99, aligned_buffer(size))
        with pytest.raises(KeyError):
            source.submit(1, 0, aligned_buffer(size))  # layer 1 is dense
        with pytest.raises(IndexError):
            source.resident(layer, [99])
    with pytest.raises(RuntimeError, match="closed"):
        source.submit(layer, 0, aligned_buffer(size))


# -- mmap: views, residency, early reads --------------------------------------------------------------


def test_mmap_view_is_the_record_without_a_copy(model_dir):
    packed = PackedModel(model_dir)
    source = open_source("mmap", packed, io_threads=2, check_records=False)
    views = {}
    for layer, expert in all_records(packed):
        v = source.view(layer, expert)
        assert v.dtype == torch.uint8 and v.numel() == record_size(packed, layer)
        assert v.numpy().tobytes() == packed.read_record(layer, expert)
        views[layer, expert] = v
    a, b = views[all_records(packed)[0]], views[all_records(packed)[1]]
    assert b.data_ptr() - a.data_ptr() == record_size(packed, all_records(packed)[0][0])  # one mapping
    source.close()
    # views outlive the source: the mapping is released with the last of them
    key = all_records(packed)[-1]
    assert views[key].numpy().tobytes() == packed.read_record(*key)


def test_direct_has_no_view_and_nothing_resident(model_dir):
    packed = PackedModel(model_dir)
    layer = packed.manifest.expert_layers[0].layer
    with open_source("direct", packed, io_threads=2) as source:
        assert source.view(layer, 0) is None
        assert source.resident(layer, [0, 1, 2]) == [False, False, False]


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to drop cached pages")
def test_mmap_resident_follows_the_page_cache(copy_dir):
    packed = PackedModel(copy_dir)
    entry = packed.manifest.expert_layers[0]
    with open_source("mmap", packed, io_threads=2) as source:
        _evict(copy_dir / entry.file)
        before = source.resident(entry.layer, list(range(entry.num_experts)))
        assert len(before) == entry.num_experts and all(isinstance(r, bool) for r in before)
        source.read(entry.layer, 2, aligned_buffer(entry.record_size))
        assert source.resident(entry.layer, [2]) == [True]
        if not any(before):  # the filesystem dropped the pages (not tmpfs), so mincore must have seen it
            assert source.resident(entry.layer, [5]) == [False]
        assert source.resident(entry.layer, []) == []


# -- O_DIRECT fallback ------------------------------------------------------------------------------


@pytest.fixture
def fresh_warning(monkeypatch):
    monkeypatch.setattr(direct_source, "_no_direct_warned", False)


def _fallback_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "O_DIRECT not supported" in r.getMessage()]


def test_direct_falls_back_when_open_refuses_o_direct(model_dir, monkeypatch, caplog, fresh_warning):
    def refuse(path):
        raise OSError(errno.EINVAL, os.strerror(errno.EINVAL), str(path))

    monkeypatch.setattr(direct_source, "_open_direct", refuse)
    packed = PackedModel(model_dir)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for _ in range(2):  # two sources, two layer files each: still one warning
            with open_source("direct", packed, io_threads=4) as source:
                for layer, expert in all_records(packed):
                    assert read_one(source, packed, layer, expert) == packed.read_record(layer, expert)
                assert source.stats()["buffered_files"] == len(packed.manifest.expert_layers)
    warnings = _fallback_warnings(caplog)
    assert len(warnings) == 1 and "using buffered reads" in warnings[0] and str(model_dir) in warnings[0]


def test_direct_falls_back_when_the_first_read_refuses_o_direct(model_dir, monkeypatch, caplog, fresh_warning):
    direct_fds = set()

    def open_pretend_direct(path):  # as on a filesystem that accepts the flag but not the reads
        fd = os.open(path, os.O_RDONLY)
        direct_fds.add(fd)
        return fd

    real_pread = direct_source._pread

    def pread(fd, buf, offset):
        if fd in direct_fds:
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_pread(fd, buf, offset)

    monkeypatch.setattr(direct_source, "_open_direct", open_pretend_direct)
    monkeypatch.setattr(direct_source, "_pread", pread)
    packed = PackedModel(model_dir)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        with open_source("direct", packed, io_threads=8) as source:
            assert source.stats()["buffered_files"] == 0
            keys = all_records(packed) * 3
            dests = [aligned_buffer(record_size(packed, layer)) for layer, _ in keys]
            futures = [source.submit(layer, expert, d) for (layer, expert), d in zip(keys, dests)]
            for f in futures:
                f.result(timeout=30)
            for (layer, expert), d in zip(keys, dests):
                assert d.numpy().tobytes() == packed.read_record(layer, expert)
            stats = source.stats()
    assert stats["errors"] == 0 and stats["buffered_files"] == len(packed.manifest.expert_layers)
    assert len(_fallback_warnings(caplog)) == 1


def test_einval_after_o_direct_worked_is_an_error(model_dir, monkeypatch):
    packed = PackedModel(model_dir)
    layer = packed.manifest.expert_layers[0].layer
    with open_source("direct", packed, io_threads=2) as source:
        if source.stats()["buffered_files"]:
            pytest.skip("this filesystem has no O_DIRECT")
        read_one(source, packed, layer, 0)  # O_DIRECT reads work here

        def pread(fd, buf, offset):
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))

        monkeypatch.setattr(direct_source, "_pread", pread)
        with pytest.raises(ExpertReadError, match=f"layer {layer} expert 1 .*Invalid argument"):
            read_one(source, packed, layer, 1)


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="needs /dev/shm")
def test_direct_reads_from_tmpfs(model_dir):
    shm = Path("/dev/shm") / f"moestream-test-{os.getpid()}"
    try:
        shutil.copytree(model_dir, shm)
        packed = PackedModel(shm)
        with open_source("direct", packed, io_threads=4) as source:
            for layer, expert in all_records(packed):
                assert read_one(source, packed, layer, expert) == packed.read_record(layer, expert)
    finally:
        shutil.rmtree(shm, ignore_errors=True)


# -- damaged records, faults, truncation ------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_a_flipped_byte_is_named_by_default(copy_dir, kind):
    packed = PackedModel(copy_dir)
    entry = packed.manifest.expert_layers[-1]
    path = copy_dir / entry.file
    data = bytearray(path.read_bytes())
    data[3 * entry.record_size + 100] ^= 0x01
    path.write_bytes(bytes(data))
    with open_source(kind, packed, io_threads=2) as source:
        read_one(source, packed, entry.layer, 2)
        with pytest.raises(ExpertReadError, match=rf"{entry.file}: layer {entry.layer} expert 3 is corrupt \(crc32"):
            read_one(source, packed, entry.layer, 3)
        read_one(source, packed, entry.layer, 4)
        assert source.stats()["errors"] == 1 and source.stats()["reads"] == 2
        if kind == "mmap":  # a mapped record would skip the check
            assert source.view(entry.layer, 3) is None
    with open_source(kind, packed, io_threads=2, check_records=False) as source:  # unchecked, the damage comes through
        assert read_one(source, packed, entry.layer, 3) == bytes(data[3 * entry.record_size:4 * entry.record_size])


def test_check_records_needs_checksums_in_the_manifest(model_dir):
    packed = PackedModel(model_dir)
    packed.manifest.expert_layers[0].crc32 = []
    with pytest.raises(FormatError, match="checksums"):
        open_source("direct", packed, check_records=True)


@pytest.mark.parametrize("kind", KINDS)
def test_injected_read_fault_is_an_expert_read_error_and_the_next_read_works(model_dir, kind):
    packed = PackedModel(model_dir)
    keys = all_records(packed)[:4]
    with open_source(kind, packed, io_threads=2) as source:
        fail_once_after(source, 2)
        assert read_one(source, packed, *keys[0]) == packed.read_record(*keys[0])
        assert read_one(source, packed, *keys[1]) == packed.read_record(*keys[1])
        layer, expert = keys[2]
        with pytest.raises(ExpertReadError) as info:
            read_one(source, packed, layer, expert)
        message = str(info.value)
        assert f"layer {layer} expert {expert}" in message and "Input/output error" in message
        assert packed.expert_layer(layer).file in message
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.EIO
        assert read_one(source, packed, *keys[3]) == packed.read_record(*keys[3])
        assert read_one(source, packed, *keys[2]) == packed.read_record(*keys[2])
        assert source.stats()["errors"] == 1 and source.stats()["reads"] == 4


def test_a_failed_read_through_read_is_an_expert_read_error_too(model_dir):
    packed = PackedModel(model_dir)
    layer = packed.manifest.expert_layers[0].layer
    with open_source("direct", packed, io_threads=2) as source:
        fail_once_after(source, 0)
        with pytest.raises(ExpertReadError, match="Input/output error"):
            source.read(layer, 0, aligned_buffer(record_size(packed, layer)))
        read_one(source, packed, layer, 0)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("cut", ["mid-record", "whole-record"])
def test_truncated_file_is_a_clear_error(copy_dir, kind, cut):
    packed = PackedModel(copy_dir)  # sizes are checked here, before the damage
    entry = packed.manifest.expert_layers[0]
    last = entry.num_experts - 1
    keep = last * entry.record_size + (1000 if cut == "mid-record" else 0)
    with open_source(kind, packed, io_threads=2) as source:
        os.truncate(copy_dir / entry.file, keep)
        with pytest.raises(ExpertReadError, match=rf"experts-\d+\.bin is truncated: layer {entry.layer} "
                                                  rf"expert {last} ends at byte \d+, but the file ends at byte {keep}"):
            read_one(source, packed, entry.layer, last)
        assert read_one(source, packed, entry.layer, 0) == (copy_dir / entry.file).read_bytes()[:entry.record_size]
        if kind == "mmap":
            assert source.view(entry.layer, last) is None
        assert source.stats()["errors"] == 1
