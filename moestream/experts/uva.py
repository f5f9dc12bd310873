"""Pinned host RAM seen by the GPU: a CUDA tensor over a page-locked host buffer.

Page-locked host memory on a machine with unified addressing is mapped into the GPU's address
space at the same address, so a kernel may read it directly (each load crosses PCIe). The slot
cache's device-driven mode uses this to copy missed records from the host tier by a kernel whose
choice of records lives on the device (moestream.kernels.triton_gather): no host round trip."""
from __future__ import annotations

import torch


class _CudaArray:
    """The __cuda_array_interface__ of a host pointer the GPU can read at the same address."""

    def __init__(self, t: torch.Tensor):
        self.keep = t  # the host tensor owns the memory
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "|u1", "version": 2,
                                         "data": (t.data_ptr(), False), "strides": None}


def device_view(host: torch.Tensor) -> torch.Tensor | None:
    """A CUDA uint8 tensor over the page-locked, contiguous uint8 CPU tensor `host` (same bytes, no
    copy), or None where this machine cannot read it that way. Checked once by reading it back."""
    if host.device.type != "cpu" or host.dtype != torch.uint8 or not host.is_contiguous() or not host.is_pinned():
        return None
    try:
        view = torch.as_tensor(_CudaArray(host), device="cuda")
    except (RuntimeError, TypeError, ValueError):
        return None
    if view.data_ptr() != host.data_ptr():
        return None
    probe = host.view(-1)[:: max(1, host.numel() // 64)]
    if not torch.equal(view.view(-1)[:: max(1, host.numel() // 64)].cpu(), probe):  # unmapped: refuse
        return None
    view.keep_alive = host  # the storage does not own the memory: hold the host tensor with it
    return view
