"""The router's softmax, top-k and renormalization in one Triton kernel.

In torch these are five kernels per MoE layer (softmax, topk, sum, divide, cast); in a launch-bound
decode step each costs more than its work. One program per token: softmax in float32 over the
layer's experts, then k rounds of "take the largest, lowest index first", then the optional
renormalization over the chosen k. Same math as MoEBlock.route; sums may round in another order.

route_rows also folds in the router product over a decode step's row tile (the rows-at-once step,
moestream.kernels.triton_rows): each program computes its block of logits as tile_linear does (the
same bits) and stores them; the last program to finish, known from a counter every program
increments (acquire-release), takes the softmax and top-k of each row with route_topk's code, then
resets the counter for the next launch. A row's choice depends only on its logits, never on which
program is last or on the other rows. With a split of K (KernelConfig.rows_narrow_split) the programs
store float32 partials and the last one adds them in tile_linear's order: the same logits."""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

from moestream.kernels.expert_layout import ACT_DTYPES, DEFAULT_CONFIG, KernelConfig
from moestream.kernels.pdl import pdl_launch
from moestream.kernels.triton_rows import MAX_ROWS, _tile_acc, split_parts, tile

MAX_FUSED_EXPERTS = 1024  # route_rows' last program holds one row of logits in registers per step


@triton.jit
def _choose(z, cols, E, weights_ptr, ids_ptr, scale_ptr, A: tl.constexpr, BLOCK_E: tl.constexpr,
            BLOCK_A: tl.constexpr, NORMALIZE: tl.constexpr, SCALE: tl.constexpr):
    """One token's routing from its logits z [BLOCK_E] (float32, -inf past E): softmax, the top A,
    renormalized if asked, times the chosen experts' scales [E] if SCALE; stores weights and ids [A]
    at weights_ptr, ids_ptr."""
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
    if SCALE:
        chosen_w = chosen_w * tl.load(scale_ptr + chosen_i, mask=slots < A, other=0.0).to(tl.float32)
    tl.store(weights_ptr + slots, chosen_w.to(weights_ptr.dtype.element_ty), mask=slots < A)
    tl.store(ids_ptr + slots, chosen_i, mask=slots < A)


@triton.jit
def _route_topk(logits_ptr, stride, weights_ptr, ids_ptr, scale_ptr, E, A: tl.constexpr, BLOCK_E: tl.constexpr,
                BLOCK_A: tl.constexpr, NORMALIZE: tl.constexpr, SCALE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    t = tl.program_id(0)
    cols = tl.arange(0, BLOCK_E)
    z = tl.load(logits_ptr + t.to(tl.int64) * stride + cols, mask=cols < E, other=float("-inf")).to(tl.float32)
    out = t.to(tl.int64) * A
    _choose(z, cols, E, weights_ptr + out, ids_ptr + out, scale_ptr, A, BLOCK_E, BLOCK_A, NORMALIZE, SCALE)


def route_topk(logits: torch.Tensor, top_k: int, *, normalize: bool, out_dtype: torch.dtype,
               expert_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] -> (weights [T, k] in out_dtype, ids [T, k] int64), largest first; each weight
    times its expert's expert_scale [E] (float32 product) where given."""
    tokens, experts = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    weights = torch.empty((tokens, top_k), dtype=out_dtype, device=logits.device)
    ids = torch.empty((tokens, top_k), dtype=torch.int64, device=logits.device)
    if tokens:
        _route_topk[(tokens,)](logits, logits.stride(0), weights, ids, _scale_arg(expert_scale, logits), experts,
                               A=top_k, BLOCK_E=triton.next_power_of_2(experts), BLOCK_A=triton.next_power_of_2(top_k),
                               NORMALIZE=normalize, SCALE=expert_scale is not None, num_warps=4 if experts > 256 else 1,
                               **pdl_launch(logits, _INTERPRETED))
    return weights, ids


@triton.jit
def _route_rows(x_ptr, w_ptr, logits_ptr, part_ptr, weights_ptr, ids_ptr, scale_ptr, counter_ptr, R, E, chosen_rows,
                stride_x,
                stride_w, K: tl.constexpr, RB: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, EVEN_K: tl.constexpr,
                SWAP: tl.constexpr, PRECISION: tl.constexpr, DOT_F32: tl.constexpr, SPLIT: tl.constexpr,
                A: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_A: tl.constexpr, NORMALIZE: tl.constexpr,
                SCALE: tl.constexpr, PDL: tl.constexpr):
    if PDL:  # launched with PDL: the kernel before it complete and visible first; the next may be scheduled
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    # logits [R, E] in x's dtype (rounded as tile_linear's output); weights, ids [R, A]; with SPLIT > 1
    # the programs store float32 partials [blocks, SPLIT, RB, BN] instead, summed in split order at the end
    first = tl.program_id(0) * BN
    KS: tl.constexpr = K // SPLIT
    s = tl.program_id(1)
    acc = _tile_acc(x_ptr + s * KS, w_ptr + s * KS, R, E, stride_x, stride_w, first, KS, RB, BN, BK, EVEN_K, SWAP,
                    PRECISION, DOT_F32)
    rows = tl.arange(0, RB)
    cols = first + tl.arange(0, BN)
    if SPLIT == 1:
        tl.store(logits_ptr + rows[:, None] * E + cols[None, :], acc.to(logits_ptr.dtype.element_ty),
                 mask=(rows < R)[:, None] & (cols < E)[None, :])
    else:
        tile = rows[:, None] * BN + tl.arange(0, BN)[None, :]
        tl.store(part_ptr + (tl.program_id(0) * SPLIT + s).to(tl.int64) * (RB * BN) + tile, acc)
    tl.debug_barrier()  # every thread's logits stored before the program counts itself done
    done = tl.atomic_add(counter_ptr, 1, sem="acq_rel")  # releases this program's logits, acquires the others'
    if done == tl.num_programs(0) * SPLIT - 1:  # the last program: every block of logits is in
        tl.atomic_xchg(counter_ptr, 0, sem="relaxed")  # the next launch counts from zero (kernels run in order)
        e = tl.arange(0, BLOCK_E)
        for r in range(0, RB):  # a trip count known at compile time, guarded (the interpreter takes no other)
            if r < chosen_rows:
                if SPLIT == 1:
                    z = tl.load(logits_ptr + r * E + e, mask=e < E, other=float("-inf"), cache_modifier=".cg")
                else:  # tile_linear's sum of the splits, in its order, rounded as its output
                    at = part_ptr + ((e // BN) * SPLIT).to(tl.int64) * (RB * BN) + r * BN + e % BN
                    z = tl.load(at, mask=e < E, other=0.0, cache_modifier=".cg")
                    for j in tl.static_range(1, SPLIT):
                        z += tl.load(at + j * (RB * BN), mask=e < E, other=0.0, cache_modifier=".cg")
                    z = tl.where(e < E, z.to(logits_ptr.dtype.element_ty).to(tl.float32), float("-inf"))
                _choose(z.to(tl.float32), e, E, weights_ptr + r * A, ids_ptr + r * A, scale_ptr, A, BLOCK_E,
                        BLOCK_A, NORMALIZE, SCALE)
        slots = tl.arange(0, BLOCK_A)
        out = rows[:, None] * A + slots[None, :]
        rest = ((rows >= chosen_rows) & (rows < R))[:, None] & (slots < A)[None, :]  # rows not asked for: zeros
        tl.store(weights_ptr + out, tl.zeros([RB, BLOCK_A], dtype=weights_ptr.dtype.element_ty), mask=rest)
        tl.store(ids_ptr + out, tl.zeros([RB, BLOCK_A], dtype=tl.int64), mask=rest)


def route_rows(x: torch.Tensor, router: torch.Tensor, top_k: int, *, normalize: bool, out_dtype: torch.dtype,
               counter: torch.Tensor, rows: int | None = None, expert_scale: torch.Tensor | None = None,
               config: KernelConfig = DEFAULT_CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """route_topk(tile_linear(x, router), ...) in one launch, for x [R, K] (a decode step's row tile,
    R <= MAX_ROWS) and router [E, K] in x's dtype: (weights [R, k] in out_dtype, ids [R, k] int64).
    rows: route only the first `rows` rows (a step's real rows; default all), the others zeros: the
    last program routes them one after another. expert_scale: as route_topk's. counter: an int32 device tensor of one zero, the
    caller's own (launches that share it must run one after another, as on one stream), left zero
    after each launch."""
    if x.dim() != 2 or router.dim() != 2 or router.shape[1] != x.shape[1] or x.dtype not in ACT_DTYPES or \
            router.dtype != x.dtype or x.stride(1) != 1 or router.stride(1) != 1:
        raise ValueError(f"x {x.dtype} {list(x.shape)}, router {router.dtype} {list(router.shape)}: expected "
                         f"[R, K] and [E, K] of one dtype (bf16, fp16, fp32), the last dimension contiguous")
    R, K = x.shape
    E = router.shape[0]
    if not 0 < R <= MAX_ROWS or not 0 < top_k <= E <= MAX_FUSED_EXPERTS or K == 0:
        raise ValueError(f"{R} rows (1..{MAX_ROWS}), top {top_k} of {E} experts (at most {MAX_FUSED_EXPERTS}), "
                         f"{K} inputs")
    if counter.dtype != torch.int32 or counter.numel() != 1 or counter.device != x.device:
        raise ValueError("counter: one int32 on x's device")
    rows = R if rows is None else rows
    if not 0 <= rows <= R:
        raise ValueError(f"rows {rows}: expected 0..{R}")
    settings = tile(E, K, x.dtype, config)
    blocks, rb = triton.cdiv(E, settings["BN"]), max(16, triton.next_power_of_2(R))
    logits = torch.empty((R, E), dtype=x.dtype, device=x.device)
    weights = torch.empty((R, top_k), dtype=out_dtype, device=x.device)
    ids = torch.empty((R, top_k), dtype=torch.int64, device=x.device)
    _route_rows[(blocks, settings["SPLIT"])](
        x, router, logits, split_parts(blocks, rb, settings, x.device), weights, ids, _scale_arg(expert_scale, x),
        counter, R, E, rows,
        x.stride(0), router.stride(0), K=K, RB=rb,
        PRECISION="ieee" if x.dtype == torch.float32 or _INTERPRETED else "tf32",
        DOT_F32=_INTERPRETED, A=top_k, BLOCK_E=triton.next_power_of_2(E), BLOCK_A=triton.next_power_of_2(top_k),
        NORMALIZE=normalize, SCALE=expert_scale is not None, **settings, **pdl_launch(x, _INTERPRETED))
    return weights, ids


def _scale_arg(expert_scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The kernels' scale pointer: the scales (contiguous), or any tensor where there are none (unread)."""
    return like if expert_scale is None else expert_scale.contiguous()


_INTERPRETED = isinstance(_route_topk, InterpretedFunction)  # under Triton's CPU interpreter (tests)
