"""The host tier: pinned RAM slots between the record source (disk) and the device slots.

A second, simpler pool with its own directory and policy, keyed by (layer, expert): a record read
from disk is kept here where there is room, and a later miss copies it from here. Reader threads add
records while the main thread pins them, so every use of its directory holds `lock` (the cache's)."""
from __future__ import annotations

import threading

import torch

from moestream.experts.buffers import aligned_buffer, pin_if_cuda
from moestream.experts.directory import CacheFullError, SlotDirectory


class HostTier:
    """Pinned RAM slots between the disk and the device slots, with their own policy."""

    def __init__(self, slots: int, slot_bytes: int, *, policy: str, pin: bool, lock: threading.Lock):
        self.slots, self.slot_bytes = slots, slot_bytes
        self.pool = aligned_buffer(slots * slot_bytes).view(slots, slot_bytes)
        if pin:
            self.pool = pin_if_cuda(self.pool)
        self.directory = SlotDirectory(slots, policy=policy)
        self.lock = lock

    def pin_ready(self, key, size: int) -> torch.Tensor | None:
        """The record's bytes if the tier holds it ready (not loading), pinned until `unpin`; else None."""
        with self.lock:
            slot = self.directory.lookup(key)
            if slot is None or self.directory.is_loading(key):
                return None
            self.directory.pin(key)
            self.directory.touch(key)
            return self.pool[slot][:size]

    def unpin(self, key) -> None:
        with self.lock:
            self.directory.unpin(key)

    def store(self, key, data: torch.Tensor, size: int) -> None:
        """Keep a copy of a record just read, where it is not held yet and a slot can be had."""
        with self.lock:
            if self.directory.lookup(key) is not None:
                return
            try:
                slot = self.directory.reserve(key).slot
            except CacheFullError:
                return
            self.pool[slot][:size].copy_(data)
            self.directory.mark_ready(key)

    def reserve(self, key) -> torch.Tensor:
        """A slot for `key` (loading until `mark_ready`): the whole slot, for a read to land in."""
        with self.lock:
            slot = self.directory.reserve(key).slot
        return self.pool[slot]

    def mark_ready(self, key) -> None:
        with self.lock:
            self.directory.mark_ready(key)
