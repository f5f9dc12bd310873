"""The Triton MoE kernels' MXFP4 variant under Triton's CPU interpreter, at tiny sizes: the gemv and
grouped kernels read MXFP4 records (e2m1 codes two per byte, an E8M0 scale per 32 inputs) and agree
with the torch reference (moestream.kernels.reference, which dequantizes with
moestream.quant.mxfp4) for SwiGLU and gpt-oss's clamped SwiGLU with its biases, with scales over a
wide exponent range, and give the same bits for any batching or slot assignment.

Runs in the interpreter's own stage (tests/interpret/interpreter.py). Skipped where Triton is not installed."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

import triton.language as tl  # noqa: E402
from interpreter import interpreted_module  # noqa: E402

from kernel_helpers import build_pool, reference_moe  # noqa: E402
from moestream.kernels.triton_moe import _e2m1_f32, _e8m0_f32  # noqa: E402
from moestream.quant import affine, mxfp4  # noqa: E402
from moestream.quant.affine import QuantSpec  # noqa: E402
from moestream.kernels.expert_layout import KernelConfig, SlotLayout, UnsupportedLayout  # noqa: E402

E, H, I, TOP_K = 7, 192, 128, 3  # an odd number of experts and of pairs per token; three 64-input steps of H
TOL = {torch.bfloat16: 4e-2, torch.float32: 1e-5}  # max |y - ref| / max |ref|, as test_kernels_interpret
CONFIG = dict(gemv_gate_up_n=128, gemv_down_n=128, gate_up_n=128, down_n=128, block_m=16, combine_tokens=64,
              combine_block=128)
CLAMPED = dict(activation="clamped_swiglu", alpha=1.702, limit=1.0)  # a low limit: the clamps bite
ACTS = {"silu": {}, "clamped_swiglu": CLAMPED}
WIDE = 30  # scale exponents within +-30 binades of the unit one: 61 binades


def test_mxfp4_bytes_read_as_int32_words_are_the_affine_4_bit_packing():
    """What lets the kernels load MXFP4 rows as the int32 words of affine 4-bit rows: a little-endian
    word m holds input 8m + j at bits 4j..4j+3 in both (MXFP4: input 2k in byte k's low nibble)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randint(0, 256, (5, 96), generator=g).to(torch.uint8)  # [out, in/2]
    scales = torch.randint(100, 150, (5, 6), generator=g).to(torch.uint8)  # [out, in/32]
    codes = torch.stack((weight & 0x0F, weight >> 4), dim=-1).reshape(5, 192).to(torch.int32)  # input order
    assert torch.equal(affine.unpack(weight.view(torch.int32), 4), codes)
    values = torch.tensor(mxfp4.E2M1)[codes] * torch.exp2(scales.double() - 127).repeat_interleave(32, dim=1)
    assert torch.equal(mxfp4.dequantize_matrix(weight, scales, torch.float64), values)


@pytest.fixture(scope="module")
def tm():
    return interpreted_module("moestream.kernels.triton_moe")


@pytest.fixture(scope="module")
def pools():
    cache = {}

    def get(spread=3, shape=(E, H, I), **activation):
        key = (spread, shape, tuple(sorted(activation.items())))
        if key not in cache:
            cache[key] = build_pool(*shape, extra_slots=4, mx_spread=spread, **activation)
        return cache[key]

    return get


def routing(tokens, dtype, seed, *, experts=E, hidden=H, top_k=TOP_K):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.rand(tokens, experts, generator=g).topk(top_k, dim=-1).indices  # [T, A] distinct experts per token
    weights = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).to(dtype)
    return x, ids, weights


def relative_error(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def reference(pool_set, x, ids, weights):
    return reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)


def run(tm, pool_set, x, ids, weights, *, mode="auto", batch=None, slot_of=None, config=CONFIG):
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


def codes_of(pool_set):
    """Every 4-bit code in the pool's records, as ints."""
    pool, fields = pool_set[:2]
    parts = [pool[:, f.offset:f.offset + f.nbytes] for f in fields if f.name.endswith(".weight")]
    return torch.cat([torch.cat((p & 0x0F, p >> 4), dim=1) for p in parts], dim=1)


def scale_exponents(pool_set):
    pool, fields, _, slot_of = pool_set
    rows = pool[slot_of]
    return torch.cat([rows[:, f.offset:f.offset + f.nbytes].reshape(-1) for f in fields if f.name.endswith(".scales")])


@pytest.mark.parametrize("mode,tokens", [("gemv", 1), ("gemv", 3), ("auto", 4), ("grouped", 5), ("grouped", 21),
                                         ("auto", 40)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("act", list(ACTS))
def test_mxfp4_records_match_the_torch_reference(tm, pools, act, dtype, mode, tokens):
    pool_set = pools(**ACTS[act])
    layout = SlotLayout.from_fields(*pool_set[1:3])
    assert layout.mx and layout.activation == act and layout.has_bias == (act == "clamped_swiglu")
    assert set(codes_of(pool_set).unique().tolist()) == set(range(16))  # -0.0 (code 8) included
    x, ids, weights = routing(tokens, dtype, seed=tokens)
    y = run(tm, pool_set, x, ids, weights, mode=mode)
    assert y.dtype == dtype and y.shape == (tokens, H)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu of a large negative gate: exp(-g) is inf
@pytest.mark.parametrize("mode,tokens", [("gemv", 2), ("grouped", 13)])
@pytest.mark.parametrize("act", list(ACTS))
def test_scales_over_a_wide_exponent_range(tm, pools, act, mode, tokens):
    pool_set = pools(WIDE, **ACTS[act])
    exps = scale_exponents(pool_set).to(torch.int32)
    assert int(exps.max() - exps.min()) >= 50
    for dtype in (torch.float32, torch.bfloat16):
        x, ids, weights = routing(tokens, dtype, seed=tokens + 1)
        y = run(tm, pool_set, x, ids, weights, mode=mode)
        assert torch.isfinite(y).all()
        assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[dtype]


@triton.jit
def _decode_kernel(code_ptr, scale_ptr, value_out, scale_out):
    i = tl.arange(0, 256)
    tl.store(value_out + i, _e2m1_f32(tl.load(code_ptr + i).to(tl.uint32)))
    tl.store(scale_out + i, _e8m0_f32(tl.load(scale_ptr + i)))


def test_codes_and_scales_decode_to_the_references_bits(tm):
    """Every e2m1 code (-0.0 with its sign) and every E8M0 scale but NaN (the subnormal 2^-127
    included) decodes to mxfp4's value, bit for bit."""
    codes = torch.arange(256, dtype=torch.int32) % 16
    scales = torch.arange(256, dtype=torch.int32).clamp(max=254).to(torch.uint8)
    values, powers = torch.empty(256), torch.empty(256)
    _decode_kernel[(1,)](codes, scales, values, powers)
    assert torch.equal(values.view(torch.int32), mxfp4.e2m1_values(codes).view(torch.int32))
    assert torch.equal(powers.view(torch.int32), mxfp4.scale_values(scales).view(torch.int32))
    assert values[8].item() == 0.0 and torch.signbit(values[8])


@pytest.mark.parametrize("tokens", [3, 21])
def test_same_bits_for_any_batching_slots_and_token_count(tm, pools, tokens):
    """Each pair's record and biases come from its own slot: moving records between slots or pinning
    a few at a time changes no bit, and in the gemv kernels a token's bits do not depend on its neighbours."""
    pool, fields, quant, slot_of = pool_set = pools(**CLAMPED)
    x, ids, weights = routing(tokens, torch.bfloat16, seed=2)
    whole = run(tm, pool_set, x, ids, weights)
    assert torch.equal(whole, run(tm, pool_set, x, ids, weights))  # run to run
    assert torch.equal(whole, run(tm, pool_set, x, ids, weights, batch=2))
    moved = pool.clone()
    new_slots = [(s + 4) % pool.shape[0] for s in slot_of]
    for e, s in enumerate(slot_of):
        moved[new_slots[e]] = pool[s]
    assert torch.equal(whole, run(tm, (moved, fields, quant, new_slots), x, ids, weights))
    if tokens <= 4:  # gemv: one token alone gives its row of the whole
        for t in range(tokens):
            alone = run(tm, pool_set, x[t:t + 1], ids[t:t + 1], weights[t:t + 1], mode="gemv")
            assert torch.equal(alone[0], whole[t])


def test_resident_table_gives_the_same_bits_and_adds_the_residual(tm, pools):
    pool, fields, quant, slot_of = pool_set = pools()
    x, ids, weights = routing(2, torch.float32, seed=5)
    batched = run(tm, pool_set, x, ids, weights, batch=2)
    plan = tm.MoEPlan(x, ids, weights, E, SlotLayout.from_fields(fields, quant), config=KernelConfig(**CONFIG))
    plan.run_table(pool, torch.tensor(slot_of, dtype=torch.int32))
    residual = torch.randn(2, H, generator=torch.Generator().manual_seed(1))
    assert torch.equal(plan.finish(), batched)
    assert torch.equal(plan.finish(residual), residual + batched)


def test_mxfp4_layouts_the_kernels_do_not_handle_are_refused_with_a_reason(tm, pools):
    _, fields, quant, _ = pools(**CLAMPED)
    lay = SlotLayout.from_fields(fields, quant)
    assert lay.scale_dtype == torch.uint8 and set(lay.offsets) == {f.name for f in fields}

    def with_field(name, **change):
        return [dataclasses.replace(f, **change) if f.name == name else f for f in fields]

    affine_down = {**quant, "down_proj": QuantSpec(4, 64, **{k: getattr(quant["down_proj"], k)
                                                             for k in ("activation", "alpha", "limit")})}
    cases = {
        "quant modes": (fields, affine_down),
        "group size 64": (fields, {p: dataclasses.replace(s, group_size=64) for p, s in quant.items()}),
        "record has no up_proj.scales": ([f for f in fields if f.name != "up_proj.scales"], quant),
        "dtype F16, expected U8": (with_field("down_proj.scales", dtype="F16"), quant),
        "not 4-byte aligned": (with_field("up_proj.weight", offset=fields[1].offset + 2), quant),
        "record has no gate_proj.bias": ([f for f in fields if f.name != "gate_proj.bias"], quant),
        "gate_proj.scales: shape": (with_field("gate_proj.scales", shape=[I, H // 64]), quant),
    }
    for reason, (bad_fields, bad_quant) in cases.items():
        with pytest.raises(UnsupportedLayout, match=reason):
            SlotLayout.from_fields(bad_fields, bad_quant)
    _, fields96, quant96, _ = build_pool(2, 96, 64, mx_spread=0)  # whole MXFP4 blocks, but not 64-input steps
    with pytest.raises(UnsupportedLayout, match="not multiples of 64"):
        SlotLayout.from_fields(fields96, quant96)


def test_routed_experts_take_the_kernels_for_mxfp4_records_on_cuda(tm, pools, caplog):
    """Which kernels a layer takes (decided without a GPU): on CUDA, Triton for MXFP4 records with
    either activation; the torch reference on the CPU, with expert parallelism, or for MXFP4 records
    the kernels refuse (a log line says why)."""
    import logging

    from moestream.layers.experts import RoutedExperts

    def layout(fields, quant, device="cuda", parallel=None):
        provider = SimpleNamespace(record_fields=lambda layer: fields, quant=lambda layer: quant)
        return RoutedExperts._layout(SimpleNamespace(parallel=parallel, device=torch.device(device), provider=provider), 0)

    for act, opts in ACTS.items():
        lay = layout(*pools(**opts)[1:3])
        assert lay.mx and lay.activation == act
    assert layout(*pools()[1:3], device="cpu") is None
    assert layout(*pools()[1:3], parallel=object()) is None
    _, fields96, quant96, _ = build_pool(2, 96, 64, mx_spread=0)
    with caplog.at_level(logging.INFO, logger="moestream.layers.experts"):
        assert layout(fields96, quant96) is None
    assert "layer 0: torch reference for routed experts (hidden 96" in caplog.text


def test_converted_gpt_oss_mxfp4_records_run_on_the_kernels(tm, tiny_checkpoint, tmp_path):
    """The records convert keeps from an MXFP4 gpt-oss checkpoint (fields and offsets as convert lays
    them out) give the torch plan's answer on the kernels."""
    for name in ("transformers", "safetensors", "tokenizers"):
        pytest.importorskip(name)
    from moestream.convert.main import convert
    from moestream.format.reader import PackedModel
    from tests.models.test_gpt_oss_mxfp4 import write_mxfp4_checkpoint

    src = write_mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "hf")
    packed = PackedModel(convert(src, tmp_path / "model", progress=False))
    for layer in packed.manifest.expert_layers:
        quant = {p: QuantSpec.from_json(q) for p, q in layer.quant.items()}
        assert {q.mode for q in quant.values()} == {mxfp4.MODE}
        pool = torch.stack([torch.frombuffer(bytearray(packed.read_record(layer.layer, e)), dtype=torch.uint8)
                            for e in range(layer.num_experts)])
        pool_set = (pool, layer.fields, quant, list(range(layer.num_experts)))
        lay = SlotLayout.from_fields(layer.fields, quant)
        assert lay.mx and lay.activation == "clamped_swiglu" and lay.has_bias
        for mode, tokens in (("gemv", 2), ("grouped", 11)):
            x, ids, weights = routing(tokens, torch.float32, seed=tokens, experts=layer.num_experts, hidden=lay.hidden,
                                      top_k=2)
            y = run(tm, pool_set, x, ids, weights, mode=mode)
            assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[torch.float32]


@pytest.mark.parametrize("act", list(ACTS))
def test_grouped_kernels_read_mxfp4(tm, pools, act):
    """The grouped kernels dequantize MXFP4 records for 21 tokens (partial row blocks)."""
    pool_set = pools(**ACTS[act])
    x, ids, weights = routing(21, torch.bfloat16, seed=3)
    y = run(tm, pool_set, x, ids, weights, mode="grouped", config=CONFIG)
    assert relative_error(y, reference(pool_set, x, ids, weights)) < TOL[torch.bfloat16]
