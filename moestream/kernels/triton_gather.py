"""Copy whole expert records between pools on the device, chosen by device tensors.

One program copies one block of one record: records `src[i]` of `source` go to rows `dst[i]` of
`dest` where `todo[i]` is set. Neither the choice nor the byte count is known on the host, so a
CUDA graph can hold the copy. `source` may be pinned host RAM seen through its unified address
(moestream.experts.uva): then the GPU's own loads pull the bytes over PCIe, with no host work
per record."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.pdl import pdl_launch

BLOCK = 4096  # 32-bit words per program (16 KiB): many programs keep many PCIe reads in flight


@triton.jit
def _gather(src_ptr, src_stride, dst_ptr, dst_stride, src_idx_ptr, dst_idx_ptr, todo_ptr, words,
            BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    i = tl.program_id(0)
    if tl.load(todo_ptr + i) == 0:
        return
    s = tl.load(src_idx_ptr + i).to(tl.int64)
    d = tl.load(dst_idx_ptr + i).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < words
    v = tl.load(src_ptr + s * src_stride + cols, mask=keep)
    tl.store(dst_ptr + d * dst_stride + cols, v, mask=keep)


def words_view(pool: torch.Tensor) -> torch.Tensor:
    """A uint8 [rows, bytes] pool as 32-bit words (rows must be a multiple of 4 bytes long)."""
    if pool.dtype != torch.uint8 or pool.dim() != 2 or pool.shape[1] % 4 or pool.stride(1) != 1:
        raise ValueError("record pools are uint8 [rows, bytes] with rows of a multiple of 4 bytes")
    return pool.view(torch.int32)


def gather_records(source: torch.Tensor, dest: torch.Tensor, src: torch.Tensor, dst: torch.Tensor,
                   todo: torch.Tensor) -> None:
    """dest[dst[i]] = source[src[i]] for every i with todo[i] (uint8 pools of equal row length)."""
    if source.shape[1] != dest.shape[1]:
        raise ValueError(f"record pools of {source.shape[1]} and {dest.shape[1]} bytes per row")
    s, d = words_view(source), words_view(dest)
    n = src.numel()
    if n:
        _gather[(n, triton.cdiv(s.shape[1], BLOCK))](s, s.stride(0), d, d.stride(0), src, dst, todo,
                                                     s.shape[1], BLOCK=BLOCK, num_warps=8, **pdl_launch(d, _INTERPRETED))


_INTERPRETED = isinstance(_gather, InterpretedFunction)  # under Triton's CPU interpreter (tests)
