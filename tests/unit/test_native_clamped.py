"""gpt-oss's experts in the native CPU kernels: the clamped SwiGLU (gate <= limit, |up| <= limit,
(up + 1) * gate * sigmoid(alpha * gate)) with the records' added gate/up/down biases, against the
torch reference (moestream.layers.clamped_swiglu on the dequantized record). The float rows within
float32 rounding (the tolerances of test_native_experts and test_native_plan), the int8 rows within
test_native_int8's bound; a pair's bits never depend on the pairs, tokens or team beside it; the
layouts refused; RoutedExperts takes the native kernels for these records."""
import dataclasses

import pytest
import torch

from moestream.cpu_share import kernels as native
from moestream.kernels.reference import projection
from moestream.layers.clamped_swiglu import clamped_swiglu
from moestream.layers.native_experts import NativePlan, native_layout
from tests.kernel_helpers import build_pool, reference_moe
from tests.unit.test_native_experts import PROJS, make_record
from tests.unit.test_native_int8 import GAUSSIAN_BOUND
from tests.unit.test_native_plan import TOLERANCE, Pool, plan_kind, routing, table_of

ALPHA, LIMIT = 1.702, 1.0  # a limit near the products' size: gate and up are clamped often (gpt-oss: 7)


@pytest.fixture(scope="module")
def module():
    built = native.load()
    assert built is not None, native.reason()
    return built


def clamped_record(hidden, inter, bits, group, scale_dtype=torch.bfloat16, bias_dtype=torch.bfloat16, seed=0):
    """make_record's codes with gpt-oss's activation and added biases (after the codes, as convert writes them)."""
    rec, quant = make_record(hidden, inter, bits, group, scale_dtype, seed=seed)
    g = torch.Generator().manual_seed(1000 + seed)
    for proj, size in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
        rec[f"{proj}.bias"] = (0.5 * torch.randn(size, generator=g)).to(bias_dtype)
    quant = {p: dataclasses.replace(q, activation="clamped_swiglu", alpha=ALPHA, limit=LIMIT) for p, q in quant.items()}
    return rec, quant


def reference(x, rec, quant):
    """x [T, H] through the record's clamped SwiGLU, as TorchPlan computes it."""
    g, u, d = (projection(rec, p, quant[p], x.dtype) for p in PROJS)
    biases = tuple(rec[f"{p}.bias"].to(x.dtype) for p in PROJS)
    return clamped_swiglu(x, g, u, d, biases=biases, alpha=ALPHA, limit=LIMIT)


def clamps(x, rec, quant) -> tuple[float, float]:
    """The shares of gate entries above the limit and of up entries beyond it (the test must see both)."""
    g, u = (torch.nn.functional.linear(x, projection(rec, p, quant[p], x.dtype), rec[f"{p}.bias"].float())
            for p in ("gate_proj", "up_proj"))
    return (g > LIMIT).float().mean().item(), (u.abs() > LIMIT).float().mean().item()


def inputs(T, hidden, seed):
    """Tokens whose products with make_record's rows (weights of unit variance) are of unit size."""
    return torch.randn(T, hidden, generator=torch.Generator().manual_seed(seed)) / hidden ** 0.5


def pairs_of(module, layout, blobs, x, experts, tokens, weights, threads=2):
    out = torch.full((len(experts), x.shape[1]), float("nan"))
    native.weighted_rows(module, layout, blobs, experts, tokens, weights, x, out, threads=threads)
    return out


EXPERTS, TOKENS, WEIGHTS = [2, 0, 2, 1, 0], [0, 0, 1, 2, 2], [0.5, -1.25, 2.0, 0.75, 1.0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hidden,inter,group", [(192, 96, 32), (320, 64, 64), (384, 128, 128)])
@pytest.mark.parametrize("scale_dtype,bias_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                    (torch.float32, torch.float16)])
def test_the_clamped_swiglu_rows_match_the_reference(module, bits, hidden, inter, group, scale_dtype, bias_dtype):
    recs = [clamped_record(hidden, inter, bits, group, scale_dtype, bias_dtype, seed=s) for s in range(3)]
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    fields, quant = native.record_blob(recs[0][0])[1], recs[0][1]
    assert native.refusal(fields, quant) is None
    x = inputs(3, hidden, seed=7)
    above, beyond = clamps(x, *recs[0])
    assert 0.05 < above < 0.6 and 0.05 < beyond < 0.6, (above, beyond)  # both clamps at work
    out = pairs_of(module, native.layout(fields, quant, int8_activations=False), blobs, x, EXPERTS, TOKENS, WEIGHTS)
    for p, (e, t, w) in enumerate(zip(EXPERTS, TOKENS, WEIGHTS)):
        ref = reference(x[t:t + 1], *recs[e])[0] * w
        assert torch.allclose(out[p], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (p, (out[p] - ref).abs().max())


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hidden,inter,group", [(192, 96, 32), (512, 256, 256)])
def test_int8_activations_stay_within_their_bound(module, bits, hidden, inter, group):
    recs = [clamped_record(hidden, inter, bits, group, seed=s) for s in range(3)]
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    fields, quant = native.record_blob(recs[0][0])[1], recs[0][1]
    x = inputs(3, hidden, seed=hidden + bits)
    floats = pairs_of(module, native.layout(fields, quant, int8_activations=False), blobs, x, EXPERTS, TOKENS, WEIGHTS)
    int8 = pairs_of(module, native.layout(fields, quant, int8_activations=True), blobs, x, EXPERTS, TOKENS, WEIGHTS)
    if not module.VNNI:  # no int8 rows: the float ones ran
        assert torch.equal(int8, floats)
        return
    for p, (e, t, w) in enumerate(zip(EXPERTS, TOKENS, WEIGHTS)):
        ref = reference(x[t:t + 1], *recs[e])[0] * w
        to_ref = ((int8[p] - ref).norm() / ref.norm()).item()
        to_float = ((int8[p] - floats[p]).norm() / floats[p].norm()).item()
        assert 1e-4 < to_float < GAUSSIAN_BOUND and to_ref < GAUSSIAN_BOUND, (p, to_float, to_ref)


@pytest.mark.parametrize("int8", [False, True])
def test_a_row_has_its_bits_alone_and_on_any_team(module, int8):
    recs = [clamped_record(256, 128, 4, 64, seed=s) for s in range(3)]
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    layout = native.layout(native.record_blob(recs[0][0])[1], recs[0][1], int8_activations=int8)
    x = inputs(3, 256, seed=3)
    together = pairs_of(module, layout, blobs, x, EXPERTS, TOKENS, WEIGHTS, threads=2)
    for threads in (1, 3):
        assert torch.equal(pairs_of(module, layout, blobs, x, EXPERTS, TOKENS, WEIGHTS, threads=threads), together)
    for p, (e, t, w) in enumerate(zip(EXPERTS, TOKENS, WEIGHTS)):
        alone = pairs_of(module, layout, blobs, x[t:t + 1], [e], [0], [w], threads=1)
        assert torch.equal(alone[0], together[p]), p


def test_clamped_layouts_the_native_kernels_refuse():
    rec, quant = clamped_record(128, 64, 4, 64)
    fields = native.record_blob(rec)[1]
    assert native.refusal(fields, quant) is None
    assert "no down_proj.bias" in native.refusal([f for f in fields if f.name != "down_proj.bias"], quant)
    unset = {p: dataclasses.replace(q, limit=None) for p, q in quant.items()}
    assert "alpha and limit" in native.refusal(fields, unset)
    mixed = native.record_blob({**rec, "up_proj.bias": rec["up_proj.bias"].float()})[1]
    assert "added biases of dtypes" in native.refusal(mixed, quant)
    short = native.record_blob({**rec, "gate_proj.bias": rec["gate_proj.bias"][:32].clone()})[1]
    assert "gate_proj.bias: shape [32]" in native.refusal(short, quant)


E, H, INTER, A = 12, 256, 128, 4
ACTIVATION = dict(activation="clamped_swiglu", alpha=ALPHA, limit=LIMIT)


@pytest.mark.parametrize("bits,down_bits", [(4, 4), (8, 8), (4, 8)])
@pytest.mark.parametrize("T", [1, 5])
def test_native_plan_matches_the_dequantized_reference(bits, down_bits, T, float_activations):
    pool, fields, quant, slot_of = build_pool(E, H, INTER, bits=bits, down_bits=down_bits, extra_slots=3, seed=bits,
                                              **ACTIVATION)
    layout = native_layout(fields, quant)
    assert layout is not None, native.reason()
    x, ids, weights = routing(T, seed=T)
    plan = NativePlan(x, ids, weights, layout, threads=1)
    plan.run_table(pool, table_of(slot_of))
    got = plan.finish()
    expected = reference_moe(x, pool, fields, quant, ids, weights, slot_of)
    assert (got - expected).abs().max().item() / expected.abs().max().item() < TOLERANCE


def test_a_steps_tokens_have_their_bits_alone():
    """step(T) gives each token the bits of its own step, in batches of experts too."""
    pool, fields, quant, slot_of = build_pool(E, H, INTER, extra_slots=2, seed=3, **ACTIVATION)
    layout = native_layout(fields, quant)
    x, ids, weights = routing(8, seed=9)
    whole = NativePlan(x, ids, weights, layout, threads=2)
    whole.run_table(pool, table_of(slot_of))
    together = whole.finish()
    experts = torch.unique(ids).tolist()
    batched = NativePlan(x, ids, weights, layout, threads=2)
    for i in range(0, len(experts), 5):
        batch = experts[i:i + 5]
        batched.run(pool, batch, [slot_of[e] for e in batch])
    assert torch.equal(batched.finish(), together)
    for t in range(8):
        alone = NativePlan(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], layout, threads=1)
        alone.run_table(pool, table_of(slot_of))
        assert torch.equal(alone.finish()[0], together[t]), t


def test_routed_experts_take_the_native_kernels_for_clamped_records():
    _, fields, quant, _ = build_pool(2, H, INTER, **ACTIVATION)
    assert plan_kind(Pool(fields, quant)) is NativePlan
