"""Page-aligned host buffers for expert records, page-locked when a CUDA device is present.

O_DIRECT reads need a page-aligned destination, and host->GPU copies are asynchronous only from
page-locked memory. An anonymous mapping gives both (registered with CUDA in place); the tensor keeps
its mapping alive and the mapping unregisters itself when freed, so a buffer stays valid and pinned
exactly as long as a view of it is in use.
"""
from __future__ import annotations

import logging
import mmap
import threading
import weakref

import torch

log = logging.getLogger(__name__)
PAGE_SIZE = mmap.PAGESIZE


class _HostMapping(mmap.mmap):
    """An anonymous mapping that unregisters itself from CUDA when it is freed."""

    cuda_registered = False

    def __del__(self):
        if self.cuda_registered:
            try:
                err = torch.cuda.cudart().cudaHostUnregister(self.address)
                if _cuda_code(err) != 0:
                    log.debug("cudaHostUnregister of a %d-byte host buffer returned %s", len(self), err)
            except Exception:  # interpreter shutdown, or CUDA already torn down
                pass


# data_ptr of each live buffer -> its mapping (weak: the tensor's storage owns the mapping)
_MAPPINGS: "weakref.WeakValueDictionary[int, _HostMapping]" = weakref.WeakValueDictionary()
_LOCK = threading.Lock()


def _cuda_code(err) -> int:
    return int(getattr(err, "value", err))


def is_page_aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % PAGE_SIZE == 0


def aligned_buffer(nbytes: int) -> torch.Tensor:
    """A zero-filled uint8 CPU tensor of ``nbytes`` whose first byte is on a page boundary."""
    if nbytes <= 0:
        raise ValueError(f"a host buffer needs a positive size, not {nbytes}")
    size = -(-nbytes // PAGE_SIZE) * PAGE_SIZE
    mapping = _HostMapping(-1, size)
    t = torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes)
    mapping.address = t.data_ptr()
    with _LOCK:
        _MAPPINGS[mapping.address] = mapping
    return t


def _mapping_of(t: torch.Tensor) -> _HostMapping | None:
    """The aligned_buffer mapping that holds all of ``t``, if any."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    with _LOCK:
        for address, mapping in list(_MAPPINGS.items()):
            if address <= start and end <= address + len(mapping):
                return mapping
    return None


def pin_if_cuda(t: torch.Tensor) -> torch.Tensor:
    """Page-lock ``t`` for asynchronous host->GPU copies (a no-op without CUDA): an aligned_buffer is
    registered in place; any other tensor, or one whose registration fails, is copied into pinned
    memory from torch. Use the returned tensor."""
    if t.device.type != "cpu" or not torch.cuda.is_available() or t.is_pinned():
        return t
    mapping = _mapping_of(t) if t.is_contiguous() else None
    if mapping is not None:
        with _LOCK:
            if mapping.cuda_registered:
                return t
            try:
                err = torch.cuda.cudart().cudaHostRegister(mapping.address, len(mapping), 0)
                ok = _cuda_code(err) == 0
            except (AttributeError, RuntimeError) as exc:  # a torch build without the binding
                err, ok = exc, False
            if ok:
                mapping.cuda_registered = True
                return t
        log.debug("cudaHostRegister of a %d-byte buffer failed (%s); copying it into pinned memory", len(mapping), err)
    pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    pinned.copy_(t)
    return pinned
