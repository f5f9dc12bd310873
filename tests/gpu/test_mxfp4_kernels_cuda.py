"""The Triton MoE kernels' MXFP4 variant on CUDA at gpt-oss's expert shape (hidden = intermediate =
2880: 45 steps of 64 inputs, partial gemv steps and output blocks): they agree with the torch
reference (moestream.kernels.reference) within the activation dtype's tolerance, with SwiGLU and
gpt-oss's clamped SwiGLU with biases, with scales over a wide exponent range, and give the same bits
for any batching, slot assignment and run."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernel_helpers import build_pool, reference_moe  # noqa: E402
from moestream.kernels import triton_moe as tm  # noqa: E402
from moestream.kernels.expert_layout import SlotLayout  # noqa: E402

DEV = "cuda"
H, I, E, A = 2880, 2880, 12, 4
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}  # max |y - ref| / max |ref|, as test_kernels
CLAMPED = dict(activation="clamped_swiglu", alpha=1.702, limit=7.0)  # gpt-oss's settings
ACTS = {"silu": {}, "clamped_swiglu": CLAMPED}


@pytest.fixture(scope="module")
def pools():
    cache = {}

    def get(spread=3, **activation):
        key = (spread, tuple(sorted(activation.items())))
        if key not in cache:
            cache[key] = build_pool(E, H, I, extra_slots=5, mx_spread=spread, device=DEV, **activation)
        return cache[key]

    return get


def routing(tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids = torch.rand(tokens, E, generator=g).topk(A, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, A, generator=g), dim=-1).to(dtype)
    return x.to(DEV), ids.to(DEV), weights.to(DEV)


def run(pool_set, x, ids, weights, *, mode="auto", batch=None, slot_of=None):
    pool, fields, quant, default_slots = pool_set
    slot_of = slot_of or default_slots
    plan = tm.MoEPlan(x, ids, weights, E, SlotLayout.from_fields(fields, quant), mode=mode)
    experts = torch.unique(ids).tolist()
    step = batch or len(experts)
    for i in range(0, len(experts), step):
        part = experts[i:i + step]
        plan.run(pool, part, [slot_of[e] for e in part])
    return plan.finish()


def relative_error(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("tokens", [1, 4, 5, 64, 300])
@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("act", list(ACTS))
def test_mxfp4_kernels_match_the_reference(pools, act, dtype, tokens):
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
    pool_set = pools(**ACTS[act])
    assert SlotLayout.from_fields(*pool_set[1:3]).mx
    x, ids, weights = routing(tokens, dtype, seed=tokens)
    ref = reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)
    y = run(pool_set, x, ids, weights)
    assert y.dtype == dtype and y.shape == (tokens, H)
    assert relative_error(y, ref) < TOL[dtype]


@pytest.mark.parametrize("mode,tokens", [("gemv", 3), ("grouped", 40)])
@pytest.mark.parametrize("act", list(ACTS))
def test_scales_over_a_wide_exponent_range(pools, act, mode, tokens):
    pool_set = pools(spread=30, **ACTS[act])
    for dtype in (torch.float32, torch.bfloat16):
        x, ids, weights = routing(tokens, dtype, seed=tokens)
        ref = reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)
        y = run(pool_set, x, ids, weights, mode=mode)
        assert torch.isfinite(y).all()
        assert relative_error(y, ref) < TOL[dtype]


@pytest.mark.parametrize("tokens", [2, 100])
def test_same_bits_for_any_batching_slot_assignment_and_run(pools, tokens):
    pool, fields, quant, slot_of = pool_set = pools(**CLAMPED)
    x, ids, weights = routing(tokens, torch.bfloat16, seed=3)
    whole = run(pool_set, x, ids, weights)
    assert torch.equal(whole, run(pool_set, x, ids, weights))
    for batch in (1, 5):
        assert torch.equal(whole, run(pool_set, x, ids, weights, batch=batch))
    moved = pool.clone()
    new_slots = [(s + 3) % pool.shape[0] for s in slot_of]
    for e, s in enumerate(slot_of):
        moved[new_slots[e]] = pool[s]
    assert torch.equal(whole, run((moved, fields, quant, new_slots), x, ids, weights))
