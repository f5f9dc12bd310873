"""The Triton MoE kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), at tiny sizes: they
agree with the torch reference math and give the same bits for any batching or slot assignment.

Triton reads TRITON_INTERPRET when it is first imported, so unless this process was started with
it, a single test runs this file again in a child process that is. Skipped where Triton is not
installed. bfloat16 tolerances are looser than on the GPU: the interpreter truncates
float32 -> bfloat16 where the GPU rounds to nearest."""

import pytest
import torch

pytest.importorskip("triton")

from interpret import interpreted_module, run_file_interpreted  # noqa: E402

from kernel_helpers import build_pool, reference_moe  # noqa: E402
from moestream.quant.affine import QuantSpec  # noqa: E402

H, I, E, A = 128, 64, 8, 2
TOL = {torch.bfloat16: 4e-2, torch.float32: 1e-5}  # max |y - ref| / max |ref|
# Big output blocks: fewer programs, and the interpreter runs programs one at a time.
FAST = dict(gemv_gate_up_n=64, gemv_down_n=128, block_m=64, down_n=128, combine_tokens=64, combine_block=128)


def test_kernels_under_the_interpreter():
    run_file_interpreted(__file__)


@pytest.fixture(scope="module")
def tm():
    return interpreted_module("moestream.kernels.triton_moe")


@pytest.fixture(scope="module")
def pools():
    cache = {}

    def get(bits, down_bits=None, scale_dtype=torch.bfloat16):
        key = (bits, down_bits, scale_dtype)
        if key not in cache:
            cache[key] = build_pool(E, H, I, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype, extra_slots=5)
        return cache[key]

    return get


def routing(tokens, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids = torch.rand(tokens, E, generator=g).topk(A, dim=-1).indices  # [T, A] distinct experts per token
    weights = torch.softmax(torch.randn(tokens, A, generator=g), dim=-1).to(dtype)
    return x, ids, weights


def relative_error(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def run(tm, pool_set, x, ids, weights, *, mode="auto", batch=None, slot_of=None):
    pool, fields, quant, default_slots = pool_set
    slot_of = slot_of or default_slots
    layout = tm.SlotLayout.from_fields(fields, quant)
    experts = torch.unique(ids).tolist()
    plan = tm.MoEPlan(x, ids, weights, E, layout, mode=mode, config=tm.KernelConfig(**FAST))
    step = batch or len(experts)
    for i in range(0, len(experts), step):
        part = experts[i:i + step]
        plan.run(pool, part, [slot_of[e] for e in part])
    return plan.finish()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_matches_reference(tm, pools, tokens, bits, dtype):
    pool_set = pools(bits)
    x, ids, weights = routing(tokens, dtype, seed=tokens)
    ref = reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)
    y = run(tm, pool_set, x, ids, weights)
    assert y.dtype == dtype and y.shape == (tokens, H)
    assert relative_error(y, ref) < TOL[dtype]


@pytest.mark.parametrize("mode", ["gemv", "grouped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_both_kernel_shapes_at_few_tokens(tm, pools, mode, dtype):
    pool_set = pools(4)
    x, ids, weights = routing(3, dtype, seed=7)
    ref = reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)
    assert relative_error(run(tm, pool_set, x, ids, weights, mode=mode), ref) < TOL[dtype]


@pytest.mark.parametrize("bits,down_bits,scale_dtype", [(4, 8, torch.bfloat16), (8, 4, torch.float16)])
def test_mixed_bits_and_fp16_scales(tm, pools, bits, down_bits, scale_dtype):
    pool_set = pools(bits, down_bits, scale_dtype)
    for tokens in (2, 40):
        x, ids, weights = routing(tokens, torch.float32, seed=tokens)
        ref = reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)
        assert relative_error(run(tm, pool_set, x, ids, weights), ref) < TOL[torch.float32]


@pytest.mark.parametrize("tokens", [2, 40])
def test_same_bits_for_any_batching_and_slot_assignment(tm, pools, tokens):
    pool, fields, quant, slot_of = pool_set = pools(4)
    x, ids, weights = routing(tokens, torch.bfloat16, seed=3)
    whole = run(tm, pool_set, x, ids, weights)
    assert torch.equal(whole, run(tm, pool_set, x, ids, weights))  # run to run
    for batch in (1, 3) if tokens < 8 else (3,):  # a small cache: the layer's experts pinned a few at a time
        assert torch.equal(whole, run(tm, pool_set, x, ids, weights, batch=batch))
    moved = pool.clone()  # the same records in other slots
    new_slots = [(s + 3) % pool.shape[0] for s in slot_of]
    for e, s in enumerate(slot_of):
        moved[new_slots[e]] = pool[s]
    assert torch.equal(whole, run(tm, (moved, fields, quant, new_slots), x, ids, weights))


@pytest.mark.parametrize("tokens", [1, 40])
def test_resident_table_gives_the_same_bits_and_adds_the_residual(tm, pools, tokens):
    """A full device slot table (every expert resident: no host list, no sync) gives the bits of
    the batched host path; the residual is added by the last kernel as a separate add would."""
    pool, fields, quant, slot_of = pool_set = pools(4)
    # float32: the interpreter truncates to bfloat16 where torch rounds, so only float32 adds compare
    x, ids, weights = routing(tokens, torch.float32, seed=5)
    batched = run(tm, pool_set, x, ids, weights, batch=3)
    plan = tm.MoEPlan(x, ids, weights, E, tm.SlotLayout.from_fields(fields, quant), config=tm.KernelConfig(**FAST))
    plan.run_table(pool, torch.tensor(slot_of, dtype=torch.int32))
    residual = torch.randn(tokens, H, generator=torch.Generator().manual_seed(1))
    assert torch.equal(plan.finish(), batched)
    assert torch.equal(plan.finish(residual), residual + batched)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("experts,top_k", [(8, 2), (60, 8), (128, 6)])
def test_router_kernel_matches_torch(normalize, experts, top_k):
    route_topk = interpreted_module("moestream.kernels.triton_route").route_topk

    g = torch.Generator().manual_seed(experts)
    for dtype in (torch.float32, torch.bfloat16):
        logits = (torch.randn(9, experts, generator=g) * 3).to(dtype)
        ref_w, ref_i = torch.topk(torch.softmax(logits, dim=-1, dtype=torch.float32), top_k, dim=-1)
        if normalize:
            ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
        w, i = route_topk(logits, top_k, normalize=normalize, out_dtype=dtype)
        assert w.dtype == dtype and i.dtype == torch.int64
        # equal probabilities (bfloat16 logits tie) may come in another order than torch's: compare as sets
        assert torch.equal(i.sort(dim=-1).values, ref_i.sort(dim=-1).values)
        torch.testing.assert_close(w.sort(dim=-1).values, ref_w.to(dtype).sort(dim=-1).values,
                                   rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


def test_layouts_the_kernels_do_not_handle_are_refused(tm, pools):
    _, fields, quant, _ = pools(4)
    tm.SlotLayout.from_fields(fields, quant)
    for bad in ({**quant, "down_proj": QuantSpec(2, 64)}, {**quant, "up_proj": QuantSpec(8, 64)},
                {**quant, "gate_proj": QuantSpec(4, 32)}, {**quant, "gate_proj": QuantSpec()}):
        with pytest.raises(tm.UnsupportedLayout):
            tm.SlotLayout.from_fields(fields, bad)


def test_no_triton_path_on_cpu(tm, pools):
    from moestream.layers.experts import RoutedExperts

    pool, fields, quant, _ = pools(4)

    class Provider:
        def record_fields(self, layer):
            return fields

        def quant(self, layer):
            return quant

    experts = RoutedExperts(Provider(), {0: E}, device=torch.device("cpu"))
    assert not experts.uses_triton(0, torch.float32)  # the layout is one the kernels take, but not on the CPU
