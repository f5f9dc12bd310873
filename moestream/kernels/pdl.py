"""Programmatic dependent launch (PDL) for the decode step's Triton kernels, on Hopper and newer.

A decode step is ~480 short kernels in one CUDA graph; between two of them the GPU idles while the
next one is scheduled (~0.5 µs each, ~0.2 ms per token at the 30B shape). Launched with PDL, a
kernel may be scheduled once every program of the one before it has started (each lets the next
launch at once: griddepcontrol.launch_dependents), so its scheduling overlaps that kernel's work;
it then waits for that kernel to complete, and for its memory to be visible, before it reads
anything (griddepcontrol.wait first: `PDL` below). Every kernel launched so waits first, and the
kernel it waits for waited for its own predecessor, so the step's order is the stream's order: the
same bits as without PDL. Off where the GPU is older than sm_90, under Triton's CPU interpreter, and with
KernelConfig.pdl = 0 (tests: the same bits either way)."""
from __future__ import annotations

import functools

import torch

from moestream.kernels.expert_layout import DEFAULT_CONFIG


@functools.lru_cache(maxsize=None)
def _capable(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_launch(t: torch.Tensor, interpreted: bool = False) -> dict:
    """A PDL kernel's launch keywords for a launch on t's device: its `PDL` constexpr (wait for the
    kernel before it) and Triton's launch_pdl option, both only where the GPU can."""
    on = bool(DEFAULT_CONFIG.pdl) and not interpreted and t.device.type == "cuda" and \
        _capable(t.device.index if t.device.index is not None else torch.cuda.current_device())
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
