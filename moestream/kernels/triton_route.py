"""The router's softmax, top-k and renormalization in one Triton kernel.

In torch these are five kernels per MoE layer (softmax, topk, sum, divide, cast); in a launch-bound
decode step each costs more than its work. One program per token: softmax in float32 over the
layer's experts, then k rounds of "take the largest, lowest index first", then the optional
renormalization over the chosen k. Same math as MoEBlock.route; sums may round in another order."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction


@triton.jit
def _route_topk(logits_ptr, stride, weights_ptr, ids_ptr, E, A: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_A: tl.constexpr, NORMALIZE: tl.constexpr):
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    z = tl.load(logits_ptr + t.to(tl.int64) * stride + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    e = tl.exp(z - tl.max(z, 0))
    p = tl.where(cols < E, e / tl.sum(e, 0), -1.0)  # padding can never be chosen
    slots = tl.arange(0, BLOCK_A)
    chosen_w = tl.zeros([BLOCK_A], dtype=tl.float32)
    chosen_i = tl.zeros([BLOCK_A], dtype=tl.int64)
    for a in tl.static_range(A):
        best = tl.max(p, 0)
        idx = tl.min(tl.where(p == best, cols, BLOCK_E), 0)
        chosen_w = tl.where(slots == a, best, chosen_w)
        chosen_i = tl.where(slots == a, idx.to(tl.int64), chosen_i)
        p = tl.where(cols == idx, -1.0, p)
    if NORMALIZE:
        chosen_w = chosen_w / tl.sum(chosen_w, 0)
    out = t.to(tl.int64) * A + slots
    tl.store(weights_ptr + out, chosen_w.to(weights_ptr.dtype.element_ty), mask=slots < A)
    tl.store(ids_ptr + out, chosen_i, mask=slots < A)


def route_topk(logits: torch.Tensor, top_k: int, *, normalize: bool, out_dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in out_dtype, ids [T, k] int64), largest first."""
    tokens, experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_topk[(tokens,)](logits, logits.stride(0), weights, ids, experts, A=top_k,
                               BLOCK_E=triton.next_power_of_2(experts), BLOCK_A=triton.next_power_of_2(top_k),
                               NORMALIZE=normalize, num_warps=4 if experts > 256 else 1)
    return weights, ids


_INTERPRETED = isinstance(_route_topk, InterpretedFunction)  # under Triton's CPU interpreter (tests)
