"""The Triton MoE kernels on CUDA: they agree with the torch reference math (moestream.kernels.reference)
within the activation dtype's tolerance, for every gated activation (SwiGLU, GELU-tanh, gpt-oss's
clamped SwiGLU with biases), give the same bits for any batching, slot assignment and run, and the
engine takes them and still gives the same tokens for every cache size."""
from dataclasses import replace

import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernel_helpers import build_pool, reference_moe  # noqa: E402
from moestream.kernels import triton_moe as tm  # noqa: E402
from moestream.layers.moe import MoEBlock  # noqa: E402
from moestream.kernels.expert_layout import DEFAULT_CONFIG, SlotLayout  # noqa: E402

DEV = "cuda"
H, I, E, A = 1024, 384, 32, 8  # I = 6 groups: partial gemv steps and output blocks get exercised
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 1e-4}  # max |y - ref| / max |ref|
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(scope="module")
def pools():
    cache = {}

    def get(bits=4, down_bits=None, scale_dtype=torch.bfloat16, *, hidden=H, inter=I, experts=E, **activation):
        key = (bits, down_bits, scale_dtype, hidden, inter, experts, tuple(sorted(activation.items())))
        if key not in cache:
            cache[key] = build_pool(experts, hidden, inter, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype,
                                    extra_slots=7, device=DEV, **activation)
        return cache[key]

    return get


def routing(tokens, dtype, *, experts=E, hidden=H, seed=0, top_k=A):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(dtype)
    return x.to(DEV), ids.to(DEV), weights.to(DEV)


def relative_error(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def reference(pool_set, x, ids, weights):
    pool, fields, quant, slot_of = pool_set
    return reference_moe(x, pool, fields, quant, ids, weights, slot_of, dtype=torch.float64)


def run(pool_set, x, ids, weights, *, mode="auto", batch=None, slot_of=None, config=DEFAULT_CONFIG):
    pool, fields, quant, default_slots = pool_set
    slot_of = slot_of or default_slots
    experts = torch.unique(ids).tolist()
    plan = tm.MoEPlan(x, ids, weights, len(slot_of), SlotLayout.from_fields(fields, quant), mode=mode,
                      config=config)
    step = batch or len(experts)
    for i in range(0, len(experts), step):
        part = experts[i:i + step]
        plan.run(pool, part, [slot_of[e] for e in part])
    return plan.finish()


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_matches_reference(pools, tokens, bits, dtype):
    dtype = DTYPES[dtype]
    pool_set = pools(bits)
    x, ids, weights = routing(tokens, dtype, seed=tokens)
    y = run(pool_set, x, ids, weights)
    assert y.dtype == dtype and y.shape == (tokens, H)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mode", ["gemv", "grouped"])
@pytest.mark.parametrize("tokens", [1, 3, 64])
def test_both_kernel_shapes(pools, tokens, mode, dtype):
    dtype = DTYPES[dtype]
    pool_set = pools(4)
    x, ids, weights = routing(tokens, dtype, seed=100 + tokens)
    y = run(pool_set, x, ids, weights, mode=mode)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("bits,down_bits,scale_dtype", [(4, 8, torch.bfloat16), (8, 4, torch.float16)])
@pytest.mark.parametrize("tokens", [2, 200])
def test_mixed_bits_and_fp16_scales(pools, bits, down_bits, scale_dtype, tokens):
    pool_set = pools(bits, down_bits, scale_dtype)
    for dtype in (torch.bfloat16, torch.float32):
        x, ids, weights = routing(tokens, dtype, seed=tokens)
        assert relative_error(run(pool_set, x, ids, weights), reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_same_bits_for_any_batching_slot_assignment_and_run(pools, tokens):
    pool, fields, quant, slot_of = pool_set = pools(4)
    x, ids, weights = routing(tokens, torch.bfloat16, seed=5)
    whole = run(pool_set, x, ids, weights)
    for _ in range(3):
        assert torch.equal(whole, run(pool_set, x, ids, weights))
    for batch in (1, 5):
        assert torch.equal(whole, run(pool_set, x, ids, weights, batch=batch))
    moved = torch.empty_like(pool)
    new_slots = [(s + 5) % pool.shape[0] for s in slot_of]
    for e, s in enumerate(slot_of):
        moved[new_slots[e]] = pool[s]
    assert torch.equal(whole, run((moved, fields, quant, new_slots), x, ids, weights))


@pytest.mark.parametrize("tokens", [1, 4, 512])
def test_qwen3_30b_a3b_shape(pools, tokens):
    pool_set = pools(4, hidden=2048, inter=768, experts=128)
    x, ids, weights = routing(tokens, torch.bfloat16, experts=128, hidden=2048, seed=tokens)
    y = run(pool_set, x, ids, weights)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[torch.bfloat16]


def test_launcher_does_not_synchronize(pools):
    pool, fields, quant, slot_of = pools(4)
    layout = SlotLayout.from_fields(fields, quant)
    for tokens in (1, 300):
        x, ids, weights = routing(tokens, torch.bfloat16, seed=9)
        experts = torch.unique(ids).tolist()  # the caller's one sync
        slots = [slot_of[e] for e in experts]
        tm.grouped_moe_ffn(x, pool, layout, ids, weights, experts, slots)  # compiles
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            tm.grouped_moe_ffn(x, pool, layout, ids, weights, experts, slots)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("tokens", [1, 300])
def test_resident_slot_table_needs_no_sync_and_gives_the_batched_bits(pools, tokens):
    """Every expert resident: the kernels index one device slot table with the router's ids, group
    the pairs on the device, add the residual, and never synchronize; same bits as the batched path."""
    pool, fields, quant, slot_of = pool_set = pools(4)
    layout = SlotLayout.from_fields(fields, quant)
    x, ids, weights = routing(tokens, torch.bfloat16, seed=11)
    batched = run(pool_set, x, ids, weights, batch=5)
    table = torch.tensor(slot_of, dtype=torch.int32, device=DEV)
    residual = torch.randn(x.shape, generator=torch.Generator(device=DEV).manual_seed(2), device=DEV).to(x.dtype)

    def resident():
        plan = tm.MoEPlan(x, ids, weights, E, layout)
        plan.run_table(pool, table)
        return plan.finish(residual)

    resident()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = resident()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, residual + batched)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("experts,top_k,normalize", [(128, 8, True), (60, 4, False), (64, 8, False), (8, 2, True)])
def test_router_kernel_matches_torch(dtype, experts, top_k, normalize):
    from moestream.kernels.triton_route import route_topk

    dtype = DTYPES[dtype]
    g = torch.Generator(device=DEV).manual_seed(experts)
    logits = (torch.randn(257, experts, generator=g, device=DEV) * 2).to(dtype)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    ref_w, ref_i = torch.topk(probs, top_k, dim=-1)
    if normalize:
        ref_w = ref_w / ref_w.sum(dim=-1, keepdim=True)
    w, i = route_topk(logits, top_k, normalize=normalize, out_dtype=dtype)
    # equal probabilities (ties among bf16 logits) may come in another order: compare as sets
    assert torch.equal(i.sort(dim=-1).values, ref_i.sort(dim=-1).values)
    torch.testing.assert_close(w.float().sort(dim=-1).values, ref_w.to(dtype).float().sort(dim=-1).values,
                               rtol=1e-5 if dtype == torch.float32 else 1e-2, atol=1e-6)


class PoolProvider:
    """An ExpertProvider over a slot pool (what the expert cache exposes), with a batch limit."""

    def __init__(self, pool_set, limit):
        self.pool, self.fields, self._quant, self.slot_of = pool_set
        self.limit, self.fetched = limit, []
        self.total_experts = len(self.slot_of)

    def quant(self, layer):
        return self._quant

    def record_fields(self, layer):
        return self.fields

    def slot_pool(self, layer):
        return self.pool

    def fetch(self, layer, experts, *, views=True):
        assert len(experts) <= self.limit
        self.fetched.append(list(experts))
        return {}

    def release(self, layer):
        pass

    def batch_limit(self, layer):
        return self.limit

    def slots_of(self, layer, experts):
        return [self.slot_of[e] for e in experts]

    def resident_table(self, layer):
        return None


@pytest.mark.parametrize("tokens", [1, 200])
def test_moe_block_takes_the_kernels(pools, tokens):
    from moestream.layers.experts import RoutedExperts
    from moestream.layers.routers import softmax_topk

    pool_set = pools(4)
    g = torch.Generator().manual_seed(1)
    router = (torch.randn(E, H, generator=g) / H ** 0.5).to(DEV, torch.bfloat16)
    route = lambda logits: softmax_topk(logits, A, normalize=True, out_dtype=logits.dtype)  # noqa: E731
    x, _, _ = routing(tokens, torch.bfloat16, seed=11)
    outs = {}
    for limit in (E, 5):
        experts = RoutedExperts(PoolProvider(pool_set, limit), {0: E}, device=torch.device(DEV))
        assert experts.uses_triton(0, x.dtype)
        outs[limit] = MoEBlock(0, router, route, experts, top_k=A)(x)
    assert torch.equal(outs[E], outs[5])  # a small cache changes nothing
    weights, ids = MoEBlock(0, router, route, experts, top_k=A).route(x)  # the torch plan's answer for the same routing
    ref = reference_moe(x, pool_set[0], pool_set[1], pool_set[2], ids, weights, pool_set[3])
    assert ((outs[E].float() - ref.float()).abs().max() / ref.float().abs().max()).item() < 4e-2


# -- GELU-tanh (Gemma 4) and the clamped SwiGLU with biases (gpt-oss) ---------------------------------------

GELU = dict(activation="gelu_tanh")
CLAMPED = dict(activation="clamped_swiglu", alpha=1.702, limit=1.0)  # a low limit: the clamps bite
ACTS = {"gelu_tanh": GELU, "clamped_swiglu": CLAMPED}


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("mode", ["gemv", "grouped", "auto"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("tokens", [1, 3, 64, 300])
def test_activations_match_reference(pools, tokens, act, bits, mode, dtype):
    dtype = DTYPES[dtype]
    pool_set = pools(bits, **ACTS[act])
    assert SlotLayout.from_fields(*pool_set[1:3]).activation == act
    x, ids, weights = routing(tokens, dtype, seed=200 + tokens)
    y = run(pool_set, x, ids, weights, mode=mode)
    assert y.dtype == dtype and y.shape == (tokens, H)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("bits,down_bits,scale_dtype,bias_dtype", [(4, 8, torch.bfloat16, torch.float32),
                                                                   (8, 4, torch.float16, torch.float16)])
@pytest.mark.parametrize("tokens", [2, 200])
def test_biases_in_other_dtypes_with_mixed_bits(pools, bits, down_bits, scale_dtype, bias_dtype, tokens):
    pool_set = pools(bits, down_bits, scale_dtype, bias_dtype=bias_dtype, **CLAMPED)
    assert SlotLayout.from_fields(*pool_set[1:3]).bias_dtype == bias_dtype
    for dtype in (torch.bfloat16, torch.float32):
        x, ids, weights = routing(tokens, dtype, seed=tokens)
        assert relative_error(run(pool_set, x, ids, weights), reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("act", list(ACTS))
@pytest.mark.parametrize("tokens", [1, 3, 300])
def test_activations_give_the_same_bits_for_any_batching_slot_assignment_and_run(pools, act, tokens):
    pool, fields, quant, slot_of = pool_set = pools(4, **ACTS[act])
    x, ids, weights = routing(tokens, torch.bfloat16, seed=5)
    whole = run(pool_set, x, ids, weights)
    for _ in range(3):
        assert torch.equal(whole, run(pool_set, x, ids, weights))
    for batch in (1, 5):
        assert torch.equal(whole, run(pool_set, x, ids, weights, batch=batch))
    moved = torch.empty_like(pool)
    new_slots = [(s + 5) % pool.shape[0] for s in slot_of]
    for e, s in enumerate(slot_of):
        moved[new_slots[e]] = pool[s]
    assert torch.equal(whole, run((moved, fields, quant, new_slots), x, ids, weights))
    if tokens <= DEFAULT_CONFIG.gemv_max_tokens:  # gemv: a token alone gets its row of the whole
        for t in range(tokens):
            assert torch.equal(run(pool_set, x[t:t + 1], ids[t:t + 1], weights[t:t + 1])[0], whole[t])


@pytest.mark.parametrize("tokens", [1, 300])
def test_biased_resident_table_needs_no_sync(pools, tokens):
    pool, fields, quant, slot_of = pool_set = pools(4, **CLAMPED)
    layout = SlotLayout.from_fields(fields, quant)
    x, ids, weights = routing(tokens, torch.bfloat16, seed=12)
    batched = run(pool_set, x, ids, weights, batch=5)
    table = torch.tensor(slot_of, dtype=torch.int32, device=DEV)

    def resident():
        plan = tm.MoEPlan(x, ids, weights, E, layout)
        plan.run_table(pool, table)
        return plan.finish()

    resident()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = resident()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(y, batched)


@pytest.mark.parametrize("tokens", [1, 4, 512])
def test_gpt_oss_20b_shape(pools, tokens):
    """gpt-oss-20b's routed experts: hidden and intermediate 2880 (45 groups), 32 experts, top-4,
    its alpha and limit, bf16 biases."""
    pool_set = pools(4, hidden=2880, inter=2880, experts=32, activation="clamped_swiglu", alpha=1.702, limit=7.0)
    x, ids, weights = routing(tokens, torch.bfloat16, experts=32, hidden=2880, seed=tokens, top_k=4)
    y = run(pool_set, x, ids, weights)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[torch.bfloat16]


def generate(model, **opts):
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    engine = Engine.load(model, options=EngineOptions(**{"device": "cuda", "prefill_chunk_tokens": 5, **opts}))
    triton_layers = [layer for layer in engine.args.moe_layers() if engine.experts.uses_triton(layer, engine.dtype)]
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
    gen = engine.generate(prompt, max_new_tokens=10, logprobs=4)
    out = [(e.token_id, e.top_logprobs) for e in gen]
    engine.close()
    return out, triton_layers


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_same_tokens_for_every_cache_size(tiny_packed_model, dtype):
    for name in ("transformers", "safetensors", "tokenizers"):  # build and convert the tiny checkpoint
        pytest.importorskip(name)
    model = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")  # bf16 scales: a layout the kernels take
    outs = {}
    for size in ("min", "25%", "all"):
        outs[size], triton_layers = generate(model, dtype=dtype, cache_size=size)
        assert triton_layers, "the engine did not take the Triton kernels"
    assert outs["min"] == outs["all"] and outs["25%"] == outs["all"]  # bitwise: same floats
    if dtype == "float32":
        ref, triton_layers = generate(model, dtype=dtype, cache_size="all", device="cpu")  # the torch plan
        assert not triton_layers
        assert [t for t, _ in ref] == [t for t, _ in outs["all"]]


GROUPED_SHAPES = [(bm, bn, "bf16", 4) for bm, bn in ((16, 64), (32, 128), (64, 64), (128, 64), (256, 64))]
GROUPED_SHAPES += [(32, 128, dtype, bits) for dtype, bits in (("fp32", 4), ("fp16", 8))]


@pytest.mark.parametrize("block_m,block_n,dtype,bits", GROUPED_SHAPES)
def test_grouped_product_shapes(pools, block_m, block_n, dtype, bits):
    """Every grouped tile the kernel sweep may choose agrees with the reference and gives the same
    bits for any batching of the experts."""
    dtype = DTYPES[dtype]
    config = replace(DEFAULT_CONFIG, block_m=block_m, gate_up_n=block_n, down_n=block_n)
    pool_set = pools(bits)
    x, ids, weights = routing(150, dtype, seed=7 + bits)
    y = run(pool_set, x, ids, weights, mode="grouped", config=config)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]
    assert torch.equal(y, run(pool_set, x, ids, weights, mode="grouped", config=config, batch=3))
