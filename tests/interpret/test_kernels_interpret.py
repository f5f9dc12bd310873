"""The Triton MoE kernels under Triton's CPU interpreter (TRITON_INTERPRET=1), at tiny sizes: they
agree with the torch reference math, for every gated activation (SwiGLU, GELU-tanh, gpt-oss's
clamped SwiGLU with its biases), and give the same bits for any batching or slot assignment.

Runs in the interpreter's own stage (tests/interpret/interpreter.py). Skipped where Triton is not
installed. bfloat16 tolerances are looser than on the GPU: the interpreter truncates
float32 -> bfloat16 where the GPU rounds to nearest."""

import dataclasses
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from interpreter import interpreted_module  # noqa: E402

from kernel_helpers import build_pool, reference_moe  # noqa: E402
from moestream.quant.affine import QuantSpec  # noqa: E402
from moestream.kernels.expert_layout import KernelConfig, SlotLayout, UnsupportedLayout  # noqa: E402

H, I, E, A = 128, 64, 8, 2
TOL = {torch.bfloat16: 4e-2, torch.float32: 1e-5}  # max |y - ref| / max |ref|
# Big output blocks: fewer programs, and the interpreter runs programs one at a time.
FAST = dict(gemv_gate_up_n=64, gemv_down_n=128, block_m=64, down_n=128, combine_tokens=64, combine_block=128)


@pytest.fixture(scope="module")
def tm():
    return interpreted_module("moestream.kernels.triton_moe")


@pytest.fixture(scope="module")
def pools():
    cache = {}

    def get(bits, down_bits=None, scale_dtype=torch.bfloat16, *, shape=(E, H, I), **activation):
        key = (bits, down_bits, scale_dtype, shape, tuple(sorted(activation.items())))
        if key not in cache:
            cache[key] = build_pool(*shape, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype, extra_slots=5,
                                    **activation)
        return cache[key]

    return get


def routing(tokens, dtype, seed=0, *, experts=E, hidden=H, top_k=A):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices  # [T, A] distinct experts per token
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(dtype)
    return x, ids, weights


def relative_error(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def run(tm, pool_set, x, ids, weights, *, mode="auto", batch=None, slot_of=None, config=FAST):
    pool, fields, quant, default_slots = pool_set
    slot_of = slot_of or default_slots
    layout = SlotLayout.from_fields(fields, quant)
    experts = torch.unique(ids).tolist()
    plan = tm.MoEPlan(x, ids, weights, len(default_slots), layout, mode=mode, config=KernelConfig(**config))
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
    plan = tm.MoEPlan(x, ids, weights, E, SlotLayout.from_fields(fields, quant), config=KernelConfig(**FAST))
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
    SlotLayout.from_fields(fields, quant)
    for bad in ({**quant, "down_proj": QuantSpec(2, 64)}, {**quant, "up_proj": QuantSpec(8, 64)},
                {**quant, "gate_proj": QuantSpec(4, 32)}, {**quant, "gate_proj": QuantSpec()}):
        with pytest.raises(UnsupportedLayout):
            SlotLayout.from_fields(fields, bad)


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


# -- the gated activations other than SwiGLU, and the records' added biases -------------------------------

GELU = dict(activation="gelu_tanh")
CLAMPED = dict(activation="clamped_swiglu", alpha=1.702, limit=1.0)  # a low limit: the clamps bite
ACTS = {"gelu_tanh": GELU, "clamped_swiglu": CLAMPED}
ODD = (7, 192, 192)  # E, H, I: three groups each way, output blocks of 128 rows left partial
ODD_TOP_K = 3
ODD_CONFIG = dict(FAST, gemv_gate_up_n=128, gate_up_n=128, block_m=16)


def odd_routing(tokens, dtype, seed):
    return routing(tokens, dtype, seed, experts=ODD[0], hidden=ODD[1], top_k=ODD_TOP_K)


def reference(pool_set, x, ids, weights):
    return reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)


@pytest.mark.parametrize("mode,tokens", [("gemv", 3), ("grouped", 21)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("act", list(ACTS))
def test_activations_match_the_torch_reference(tm, pools, act, bits, dtype, mode, tokens):
    pool_set = pools(bits, shape=ODD, **ACTS[act])
    layout = SlotLayout.from_fields(*pool_set[1:3])
    assert layout.activation == act and layout.has_bias == (act == "clamped_swiglu")
    x, ids, weights = odd_routing(tokens, dtype, seed=bits + tokens)
    y = run(tm, pool_set, x, ids, weights, mode=mode, config=ODD_CONFIG)
    assert y.dtype == dtype and y.shape == (tokens, ODD[1])
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.parametrize("mode,tokens", [("gemv", 2), ("grouped", 13)])
@pytest.mark.parametrize("bits,down_bits,scale_dtype,bias_dtype", [(4, 8, torch.bfloat16, torch.float32),
                                                                   (8, 4, torch.float16, torch.float16)])
def test_biases_in_other_dtypes_with_mixed_bits(tm, pools, bits, down_bits, scale_dtype, bias_dtype, mode, tokens):
    pool_set = pools(bits, down_bits, scale_dtype, shape=ODD, bias_dtype=bias_dtype, **CLAMPED)
    assert SlotLayout.from_fields(*pool_set[1:3]).bias_dtype == bias_dtype
    for dtype in (torch.bfloat16, torch.float32):
        x, ids, weights = odd_routing(tokens, dtype, seed=tokens)
        y = run(tm, pool_set, x, ids, weights, mode=mode, config=ODD_CONFIG)
        assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


def test_the_test_records_exercise_the_clamps_and_biases(pools):
    """The clamped records' limit and biases change the answer far beyond the tolerance, so the
    kernel tests above fail if a kernel drops either."""
    x, ids, weights = odd_routing(9, torch.float32, seed=1)
    clamped = reference(pools(4, shape=ODD, **CLAMPED), x, ids, weights)
    unclamped = reference(pools(4, shape=ODD, **{**CLAMPED, "limit": 1e4}), x, ids, weights)  # same weights
    assert relative_error(unclamped, clamped) > 0.05
    pool, fields, quant, slot_of = pools(4, shape=ODD, **CLAMPED)
    no_bias = pool.clone()
    for f in fields:
        if f.name.endswith(".bias"):
            no_bias[:, f.offset:f.offset + f.nbytes] = 0
    assert relative_error(reference((no_bias, fields, quant, slot_of), x, ids, weights), clamped) > 0.05


@pytest.mark.parametrize("tokens", [3, 21])
def test_biased_records_give_the_same_bits_for_any_batching_slots_and_token_count(tm, pools, tokens):
    """Biases are read from each pair's own slot: moving records between slots or pinning a few at
    a time changes no bit, and in the gemv kernels a token's bits do not depend on its neighbours."""
    pool, fields, quant, slot_of = pool_set = pools(4, shape=ODD, **CLAMPED)
    x, ids, weights = odd_routing(tokens, torch.bfloat16, seed=2)
    whole = run(tm, pool_set, x, ids, weights, config=ODD_CONFIG)
    assert torch.equal(whole, run(tm, pool_set, x, ids, weights, batch=2, config=ODD_CONFIG))
    moved = pool.clone()
    new_slots = [(s + 4) % pool.shape[0] for s in slot_of]
    for e, s in enumerate(slot_of):
        moved[new_slots[e]] = pool[s]
    assert torch.equal(whole, run(tm, (moved, fields, quant, new_slots), x, ids, weights, config=ODD_CONFIG))
    if tokens <= 4:  # gemv: one token alone gives its row of the whole
        for t in range(tokens):
            alone = run(tm, pool_set, x[t:t + 1], ids[t:t + 1], weights[t:t + 1], mode="gemv", config=ODD_CONFIG)
            assert torch.equal(alone[0], whole[t])


def test_activation_layouts_the_kernels_do_not_handle_are_refused(tm, pools):
    _, fields, quant, _ = pools(4, **CLAMPED)
    SlotLayout.from_fields(fields, quant)

    def with_quant(**change):
        return {p: dataclasses.replace(s, **change) for p, s in quant.items()}

    def with_field(name, **change):
        return [dataclasses.replace(f, **change) if f.name == name else f for f in fields]

    for bad_fields, bad_quant in ((fields, with_quant(activation="relu")), (fields, with_quant(limit=None)),
                                  ([f for f in fields if f.name != "up_proj.bias"], quant),
                                  (with_field("down_proj.bias", dtype="I32"), quant),
                                  (with_field("gate_proj.bias", shape=[I + 64]), quant),
                                  (with_field("up_proj.bias", dtype="F32"), quant),  # one dtype for all three
                                  (with_field("down_proj.bias", offset=fields[-1].offset + 2, dtype="F32"), quant)):
        with pytest.raises(UnsupportedLayout):
            SlotLayout.from_fields(bad_fields, bad_quant)


def test_routed_experts_take_the_kernels_for_every_activation_on_cuda(tm, pools):
    """Which kernels a CUDA layer would take (decided without a GPU): Triton for SwiGLU, GELU-tanh
    and the clamped SwiGLU with biases; the torch reference only for a layout the kernels refuse."""
    from moestream.layers.experts import RoutedExperts
    from moestream.quant.affine import QuantSpec

    def layout(pool_set):
        provider = SimpleNamespace(record_fields=lambda layer: pool_set[1], quant=lambda layer: pool_set[2])
        return RoutedExperts._layout(SimpleNamespace(parallel=None, device=torch.device("cuda"), provider=provider), 0)

    for act, opts in {"silu": {}, **ACTS}.items():
        assert layout(pools(4, **opts)).activation == act
    _, fields, quant, _ = pools(4, **CLAMPED)
    unquantized = (None, fields, {**quant, "down_proj": QuantSpec(None, 64, **{k: getattr(quant["down_proj"], k)
                                                                             for k in ("activation", "alpha", "limit")})})
    assert layout(unquantized) is None  # a genuine fallback: the kernels read quantized records only


@pytest.mark.parametrize("family,activation", [("gemma4_text", "gelu_tanh"), ("gpt_oss", "clamped_swiglu")])
def test_converted_family_records_run_on_the_kernels(tm, tiny_packed_model, family, activation):
    """The records the converter writes for Gemma 4 and gpt-oss (their bias fields and offsets as
    convert lays them out) give the torch plan's answer on the kernels."""
    for name in ("transformers", "safetensors", "tokenizers"):
        pytest.importorskip(name)
    from moestream.format.reader import PackedModel
    from moestream.quant.affine import QuantSpec

    packed = PackedModel(tiny_packed_model(family, "q4", dtype="bfloat16"))
    layer = packed.manifest.expert_layers[0]
    quant = {p: QuantSpec.from_json(q) for p, q in layer.quant.items()}
    pool = torch.stack([torch.frombuffer(bytearray(packed.read_record(layer.layer, e)), dtype=torch.uint8)
                        for e in range(layer.num_experts)])
    slot_of = list(range(layer.num_experts))
    pool_set = (pool, layer.fields, quant, slot_of)
    lay = SlotLayout.from_fields(layer.fields, quant)
    assert lay.activation == activation and lay.has_bias == (family == "gpt_oss")
    hidden = lay.hidden
    for mode, tokens in (("gemv", 2), ("grouped", 11)):
        x, ids, weights = routing(tokens, torch.float32, seed=tokens, experts=layer.num_experts, hidden=hidden)
        y = run(tm, pool_set, x, ids, weights, mode=mode)
        assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("bits,act", [(4, None), (8, "clamped_swiglu")])
def test_grouped_kernels_match_the_reference_on_odd_shapes(tm, pools, dtype, bits, act):
    """The grouped kernels compute the same FFN on odd shapes: partial output blocks, biases."""
    pool_set = pools(bits, shape=ODD, **ACTS.get(act, {}))
    x, ids, weights = odd_routing(21, dtype, seed=bits)
    y = run(tm, pool_set, x, ids, weights, mode="grouped", config=ODD_CONFIG)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]
