"""Products over a decode step's fixed row tile in Triton: y [R, N] = x [R, K] @ W [N, K]^T (+ bias).

A decode step with its rows at once (moestream.engine.decoder) multiplies all MAX_STEP_TOKENS = 16
rows of the residual stream by each attention and router matrix whatever T, so a row's bits never
depend on T. At 16 rows such a product is bound by the weight bytes (the q/k/v matrix of
Qwen3-30B-A3B is 21 MB, its rows are 4 KB), and cuBLAS reaches ~1.9-2.7 TB/s of the H200's 4.3 with
a split-K reduce for some (measured: docs/PERFORMANCE.md). This kernel streams W once:

  - one program per block of BN output columns and split of K, looping over its K / SPLIT inputs in
    steps of BK; with SPLIT > 1 (products with few column blocks, whose programs would leave most of
    the GPU's memory pipes idle) each program stores its float32 partial sums, and the last of a
    column block's programs to finish (a counter per block, acquire-release) adds the SPLIT partials
    in split order: a fixed order whichever program is last, so the bits are the same every run;
  - each step one tl.dot of the [RB, BK] x tile and the [BN, BK] weight tile (or, `swap`, the
    weights on the MMA's M side: Hopper's wgmma takes M >= 64), float32 accumulation, several
    pipeline stages of loads in flight;
  - x's rows padded to RB >= 16 (a tl.dot tile) by reading its last row again; W's columns past
    N read its last row: no masks in the loop unless K is not a multiple of BK. Padding is never stored.

Row r of the output is its own row of x times W: the MMA computes each output from one row and one
column, and the tile's shape follows from R, N, K and the dtype alone, so a row's bits do not depend
on the rows beside it (tests/interpret/test_rows_products_interpret.py, tests/gpu/test_rows_products_cuda.py).
Block sizes and splits come from KernelConfig (rows_* fields),
one set for each class of shape (row_class: narrow, a router; deep, an o projection; wide, the rest);
the split follows from the shape and the config alone, like the tile. The product's loop
(_tile_acc) is shared with the router kernel that also takes the top-k (moestream.kernels.triton_route).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.expert_layout import ACT_DTYPES, DEFAULT_CONFIG, KernelConfig
from moestream.kernels.pdl import pdl_launch

MAX_ROWS = 64  # rows of x one call takes (the decoder's tile is 16)
MAX_SPLIT_BLOCKS = 4096  # column blocks a split product may have: one counter each (_counters)


@triton.jit
def _tile_acc(x_ptr, w_ptr, R, N, stride_x, stride_w, first, K: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr,
              BK: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr,
              DOT_F32: tl.constexpr):
    """The float32 [RB, BN] product of x's rows and W's columns first..first+BN-1 (see the module doc)."""
    w_ptr += first.to(tl.int64) * stride_w
    kk = tl.arange(0, BK)
    rows = tl.arange(0, RB)
    cols = first + tl.arange(0, BN)
    # padding rows of x read its last row, columns past N the weights' last row: unmasked loads
    x_tile = x_ptr + tl.minimum(rows, R - 1)[:, None] * stride_x + kk[None, :]
    w_tile = w_ptr + (tl.minimum(cols, N - 1) - first)[:, None] * stride_w + kk[None, :]
    if SWAP:
        acc = tl.zeros([BN, RB], dtype=tl.float32)
    else:
        acc = tl.zeros([RB, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        if EVEN_K:
            xt = tl.load(x_tile + k0)
            wt = tl.load(w_tile + k0)
        else:
            kmask = (k0 + kk < K)[None, :]
            xt = tl.load(x_tile + k0, mask=kmask, other=0.0)
            wt = tl.load(w_tile + k0, mask=kmask, other=0.0)
        if DOT_F32:  # the interpreter: its tl.dot (a BLAS call) rounds a row by its place in the tile
            xt = xt.to(tl.float32)
            wt = wt.to(tl.float32)
            if SWAP:
                acc += tl.sum(wt[:, None, :] * xt[None, :, :], axis=2)
            else:
                acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
        elif SWAP:
            acc = tl.dot(wt, tl.trans(xt), acc, input_precision=PRECISION)
        else:
            acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
    if SWAP:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _split_acc(x_ptr, w_ptr, part_ptr, counter_ptr, R, N, stride_x, stride_w, first, K: tl.constexpr,
               RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr, SWAP: tl.constexpr,
               PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr):
    """This program's [RB, BN] product over its split of K (program_id(1)); with SPLIT > 1 also
    (partials [blocks, SPLIT, RB, BN] float32, counter_ptr this column block's counter): the sum of
    every split's partial in split order where this program is its block's last, and `last` says so."""
    KS: tl.constexpr = K // SPLIT
    s = tl.program_id(1)
    acc = _tile_acc(x_ptr + s * KS, w_ptr + s * KS, R, N, stride_x, stride_w, first, KS, RB, BN, BK, EVEN_K, SWAP,
                    PRECISION, DOT_F32)
    last = True
    if SPLIT > 1:
        tile = tl.arange(0, RB)[:, None] * BN + tl.arange(0, BN)[None, :]
        block = part_ptr + tl.program_id(0).to(tl.int64) * (SPLIT * RB * BN)
        tl.store(block + s * (RB * BN) + tile, acc)
        tl.debug_barrier()  # every thread's partial stored before the program counts itself done
        done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")  # releases this partial, acquires the others'
        last = done == SPLIT - 1
        if last:
            tl.atomic_xchg(counter_ptr, 0, sem="relaxed")  # the next launch counts from zero (kernels run in order)
            acc = tl.load(block + tile, cache_modifier=".cg")
            for j in tl.static_range(1, SPLIT):
                acc += tl.load(block + j * (RB * BN) + tile, cache_modifier=".cg")
    return acc, last


@triton.jit
def _tile_linear_kernel(x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr, counters_ptr, R, N, stride_x, stride_w, stride_y,
                        K: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                        HAS_BIAS: tl.constexpr, SWAP: tl.constexpr, PRECISION: tl.constexpr,
                        DOT_F32: tl.constexpr, SPLIT: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    first = tl.program_id(0) * BN
    acc, last = _split_acc(x_ptr, w_ptr, part_ptr, counters_ptr + tl.program_id(0), R, N, stride_x, stride_w, first,
                           K, RB, BN, BK, EVEN_K, SWAP, PRECISION, DOT_F32, SPLIT)
    if last:
        rows = tl.arange(0, RB)
        cols = first + tl.arange(0, BN)
        cmask = cols < N
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows[:, None] * stride_y + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=(rows < R)[:, None] & cmask[None, :])


# Triton's CPU interpreter multiplies bfloat16 dot operands as their raw bits: there they are widened first.
_INTERPRETED = isinstance(_tile_linear_kernel, InterpretedFunction)


ROW_CLASSES = {"narrow": "rows_narrow_", "deep": "rows_deep_", "wide": "rows_"}  # KernelConfig's field prefixes


def row_class(N: int, K: int, config: KernelConfig = DEFAULT_CONFIG) -> str:
    """Which of KernelConfig's three sets of sizes a product of N outputs over K inputs takes."""
    return "narrow" if N <= config.rows_narrow_max else "deep" if K >= config.rows_deep_from else "wide"


def tile(N: int, K: int, dtype: torch.dtype, config: KernelConfig = DEFAULT_CONFIG) -> dict:
    """The launch settings of a product with N outputs over K inputs: a function of the shape,
    the dtype and the config alone, so a row's bits are too."""
    prefix = ROW_CLASSES[row_class(N, K, config)]
    bn, bk, warps, stages, swap, split = (getattr(config, prefix + f) for f in ("n", "k", "warps", "stages", "swap",
                                                                               "split"))
    if N > config.rows_narrow_max and triton.cdiv(N, bn) >= config.rows_split_below:  # programs enough (a head)
        split = 1
    if dtype == torch.float32:  # an FMA dot holds its tiles in registers: keep them small
        bk = min(bk, 64)
    bk = min(bk, max(16, triton.next_power_of_2(K)))
    # a split takes whole steps of K; fewer splits where K does not divide so
    while split > 1 and (K % (split * bk) or triton.cdiv(N, bn) > MAX_SPLIT_BLOCKS):
        split //= 2
    return dict(BN=bn, BK=bk, EVEN_K=K % bk == 0, SWAP=bool(swap), SPLIT=max(1, split), num_warps=warps,
                num_stages=stages)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor:
    """MAX_SPLIT_BLOCKS int32 zeros on `device`, shared by every split product there: each launch
    leaves them zero, and launches on one device run one after another (one stream, as the
    engine's). Made once and kept, since CUDA graphs hold their address; the decoder's eager
    warm-up step makes them before any capture."""
    if device not in _COUNTERS:
        _COUNTERS[device] = torch.zeros(MAX_SPLIT_BLOCKS, dtype=torch.int32, device=device)
    return _COUNTERS[device]


def split_parts(blocks: int, rows: int, settings: dict, device: torch.device) -> torch.Tensor:
    """The float32 partials a launch of `settings` over `blocks` column blocks writes (none without a split)."""
    split = settings["SPLIT"]
    return torch.empty(blocks * split * rows * settings["BN"] if split > 1 else 1, dtype=torch.float32, device=device)


def tile_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                out: torch.Tensor | None = None, config: KernelConfig = DEFAULT_CONFIG) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [R, K] (R <= MAX_ROWS rows, e.g. a decode step's 16-row tile)
    and weight [N, K], one dtype (bf16, fp16 or fp32), float32 accumulation, the output in x's
    dtype. Rows of x and weight may be strided (last dimension contiguous). One launch, no host sync."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"x {list(x.shape)} and weight {list(weight.shape)}: expected [R, K] and [N, K]")
    if x.dtype not in ACT_DTYPES or weight.dtype != x.dtype:
        raise ValueError(f"x {x.dtype}, weight {weight.dtype}: one of bf16, fp16, fp32 for both")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight: the last dimension must be contiguous")
    R, K = x.shape
    N = weight.shape[0]
    if not 0 < R <= MAX_ROWS:
        raise ValueError(f"x has {R} rows (the kernel takes 1..{MAX_ROWS})")
    if bias is not None and (bias.shape != (N,) or bias.dtype != x.dtype or not bias.is_contiguous()):
        raise ValueError(f"bias: {bias.dtype} {list(bias.shape)}, expected contiguous {x.dtype} [{N}]")
    if out is None:
        out = torch.empty((R, N), dtype=x.dtype, device=x.device)
    elif out.shape != (R, N) or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(f"out: {out.dtype} {list(out.shape)}, expected {x.dtype} [{R}, {N}]")
    if N == 0:
        return out
    if K == 0:
        return out.copy_(bias.expand(R, N)) if bias is not None else out.zero_()
    settings = tile(N, K, x.dtype, config)
    blocks, rb = triton.cdiv(N, settings["BN"]), max(16, triton.next_power_of_2(R))
    _tile_linear_kernel[(blocks, settings["SPLIT"])](
        x, weight, weight if bias is None else bias, out, split_parts(blocks, rb, settings, x.device),
        _counters(x.device), R, N, x.stride(0), weight.stride(0), out.stride(0), K=K, RB=rb, HAS_BIAS=bias is not None,
        PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32", DOT_F32=_INTERPRETED, **settings,
        **pdl_launch(x, _INTERPRETED))
    return out
