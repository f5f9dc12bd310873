"""A device-side wait for a value the host writes into pinned RAM (moestream.cpu_share.share).

One program polls a 64-bit word of page-locked host memory (seen at its unified address,
moestream.experts.uva) until it equals the sequence number the device posted, or the host marks
that number failed (its negative), or a spin budget runs out. It writes 1 (the host's answer is
there) or 0 (failed or late: the caller computes the work itself) to a device flag, and counts the
zeros. Where the device asked nothing (the count it wrote itself, in device memory, is 0) it writes
1 at once, without a single read of host memory. So a CUDA graph can wait for the CPU without any
host launch or sync; the flag, not the host, decides what runs next (every later kernel reads it)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction
from moestream.kernels.pdl import pdl_launch


@triton.jit
def _wait_for_host(ack_ptr, seq_ptr, ok_ptr, late_ptr, asked_ptr, max_spins, PDL: tl.constexpr):
    if PDL:  # launched with PDL (moestream.kernels.pdl): the kernel before it complete and visible first
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    want = tl.load(seq_ptr)
    asked = tl.load(asked_ptr) > 0
    # volatile: each poll reads the host's memory again; nothing asked: no read, the answer is "there"
    got = tl.load(ack_ptr, mask=asked, other=want, volatile=True)
    spins = 0
    while (got != want) & (got != -want) & (spins < max_spins):
        got = tl.load(ack_ptr, volatile=True)
        spins += 1
    ok = got == want
    tl.store(ok_ptr, ok.to(tl.int32))
    tl.store(late_ptr, tl.load(late_ptr) + 1 - ok.to(tl.int64))


def wait_for_host(ack: torch.Tensor, seq: torch.Tensor, ok: torch.Tensor, late: torch.Tensor, asked: torch.Tensor,
                  max_spins: int) -> None:
    """ack: int64 [1] the host writes (a device view of pinned RAM); seq: int64 [1+] whose first
    entry is the number waited for; ok: int32 [1] set to 1 or 0; late: int64 [1] += 1 on a 0;
    asked: int64 [1+] (device) whose first entry is 0 where nothing was asked (then ok = 1 at once)."""
    _wait_for_host[(1,)](ack, seq, ok, late, asked, max_spins, num_warps=1, **pdl_launch(seq, _INTERPRETED))


_INTERPRETED = isinstance(_wait_for_host, InterpretedFunction)  # under Triton's CPU interpreter (tests)
