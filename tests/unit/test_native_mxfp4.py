"""MXFP4 records (moestream.quant.mxfp4: e2m1 codes, one E8M0 scale per 32 inputs, what convert keeps
of gpt-oss's checkpoints) in the native CPU kernels, against the dequantized matrices: the float rows
within float32 rounding of the torch reference (TorchPlan's arithmetic); the int8 rows within float32
rounding of the exact matrices times the inputs as `int8_rounded` gives them (x, then h), as the
affine records' int8 products are (tests/unit/test_packed_matrix.py); SwiGLU and gpt-oss's clamped
SwiGLU with its added biases; every scale from 0 (2^-127, a subnormal) to 254 (2^127), where -12 s
of the int8 rows' affine form would overflow; a scale of 255 (NaN in E8M0, refused by convert) never
gives a finite row, as in the reference. One token and many (the token tiles), any team, a pair's
bits alone; the CPU share's worker serves them; the MXFP4 layouts refused; RoutedExperts takes the
native kernels for these records."""
import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from moestream.cpu_share import kernels as native
from moestream.cpu_share.worker import NativeWorker
from moestream.kernels.reference import int8_rounded
from moestream.layers.native_experts import NativePlan, native_layout
from moestream.quant import mxfp4
from tests.kernel_helpers import build_pool, random_mxfp4_expert, reference_moe
from tests.unit.test_native_plan import TOLERANCE, Pool, plan_kind, routing, table_of
from tests.unit.test_native_worker import post

PROJS = ("gate_proj", "up_proj", "down_proj")
ALPHA, LIMIT = 1.702, 1.0  # a limit near the products' size: both clamps at work (gpt-oss: 7)
ACTIVATIONS = {"silu": {}, "clamped_swiglu": dict(activation="clamped_swiglu", alpha=ALPHA, limit=LIMIT)}
SHAPES = [(192, 96), (576, 320), (1024, 512)]  # rows shorter than a block of 16 scales, with a tail, whole blocks
EXPERTS, TOKENS, WEIGHTS = [2, 0, 2, 1, 0], [0, 0, 1, 2, 2], [0.5, -1.25, 2.0, 0.75, 1.0]


@pytest.fixture(scope="module")
def module():
    built = native.load()
    assert built is not None, native.reason()
    return built


def records(hidden, inter, activation, n=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [random_mxfp4_expert(hidden, inter, generator=g, **ACTIVATIONS[activation]) for _ in range(n)]


def exact(rec, proj) -> torch.Tensor:
    """A projection's matrix in float64: e2m1 values times 2^(e - 127), every scale finite (254: 2^127)."""
    w, s = rec[f"{proj}.weight"], rec[f"{proj}.scales"]
    codes = torch.stack((w & 15, w >> 4), dim=-1).reshape(w.shape[0], -1).long()
    values = torch.tensor(mxfp4.E2M1, dtype=torch.float64)[codes]
    return values * torch.exp2(s.double() - 127).repeat_interleave(mxfp4.VALUES_PER_BLOCK, dim=1)


def ffn(x, rec, quant, *, int8: bool, dtype=torch.float64) -> torch.Tensor:
    """x [T, H] through the record's gated FFN on its dequantized matrices (float64: exact ones; float32:
    the torch reference's); int8: the inputs of gate/up and of down as the int8 rows take them."""
    taken = int8_rounded if int8 else (lambda v: v)
    g, u, d = (exact(rec, p).to(dtype) for p in PROJS)
    xs = taken(x.float()).to(dtype)
    gate, up = xs @ g.T, xs @ u.T
    if quant["gate_proj"].activation == "clamped_swiglu":
        gate = (gate + rec["gate_proj.bias"].to(dtype)).clamp(max=LIMIT)
        up = (up + rec["up_proj.bias"].to(dtype)).clamp(-LIMIT, LIMIT)
        h = (up + 1) * (gate * torch.sigmoid(gate * ALPHA))
    else:
        h = F.silu(gate) * up
    y = taken(h.float()).to(dtype) @ d.T
    if quant["gate_proj"].activation == "clamped_swiglu":
        y = y + rec["down_proj.bias"].to(dtype)
    return y


def pairs_of(module, recs, x, *, int8: bool, experts=EXPERTS, tokens=TOKENS, weights=WEIGHTS, threads=2):
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    fields, quant = native.record_blob(recs[0][0])[1], recs[0][1]
    assert native.refusal(fields, quant) is None
    out = torch.full((len(experts), x.shape[1]), float("nan"))
    native.weighted_rows(module, native.layout(fields, quant, int8_activations=int8), blobs, experts, tokens, weights,
                         x, out, threads=threads)
    return out


def worst(got, want) -> float:
    """The largest error relative to the largest entry, per row of pairs."""
    return max(((g.double() - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))


def expected(recs, x, *, int8: bool, dtype=torch.float64, experts=EXPERTS, tokens=TOKENS, weights=WEIGHTS):
    return [ffn(x[t:t + 1], *recs[e], int8=int8, dtype=dtype)[0] * w for e, t, w in zip(experts, tokens, weights)]


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_float_rows_match_the_dequantized_reference(module, hidden, inter, activation):
    recs = records(hidden, inter, activation, seed=hidden)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(7))
    got = pairs_of(module, recs, x, int8=False)
    assert worst(got, expected(recs, x, int8=False, dtype=torch.float32)) < TOLERANCE
    assert worst(got, expected(recs, x, int8=False)) < TOLERANCE


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("hidden,inter", SHAPES)
def test_int8_rows_are_the_matrices_times_int8_rounded_inputs(module, hidden, inter, activation):
    recs = records(hidden, inter, activation, seed=hidden + 1)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(8))
    got = pairs_of(module, recs, x, int8=True)
    if not module.VNNI:  # no int8 rows: the float ones ran
        assert torch.equal(got, pairs_of(module, recs, x, int8=False))
        return
    assert worst(got, expected(recs, x, int8=True)) < TOLERANCE
    assert worst(got, expected(recs, x, int8=False)) > 1e-4  # the rounding is there, and the reference has it


def extreme_pair(hidden, inter, scales: tuple[int, int], level: int, seed: int):
    """An expert whose gate and up groups all take one of `scales` (the same for every row, drawn per
    group) and a token scaled per group by 2^(level - e), so each group's products have a similar size."""
    g = torch.Generator().manual_seed(seed)
    rec, quant = random_mxfp4_expert(hidden, inter, generator=g)
    groups = hidden // mxfp4.VALUES_PER_BLOCK
    e = torch.tensor(scales)[torch.randint(0, 2, (groups,), generator=g)]
    for proj in ("gate_proj", "up_proj"):
        rec[f"{proj}.scales"] = e.to(torch.uint8).expand(inter, groups).contiguous()
    x = torch.randn(1, hidden, generator=g) * torch.exp2(level - e.double()).repeat_interleave(32).float()
    return (rec, quant), x


@pytest.mark.parametrize("int8", [False, True])
def test_extreme_scales(module, int8):
    """Scales 0 and 1 (2^-127, a subnormal, and 2^-126) on inputs near 2^121; 253 and 254 (2^126,
    2^127; -12 s and the dequantized 6 * 2^127 overflow float32) on inputs near 2^-109."""
    low, x_low = extreme_pair(576, 320, (0, 1), 121, seed=1)
    high, x_high = extreme_pair(576, 320, (253, 254), 145, seed=2)
    recs, x = [low, high], torch.cat([x_low, x_high])
    assert torch.isinf(mxfp4.dequantize_matrix(high[0]["gate_proj.weight"], high[0]["gate_proj.scales"])).any()
    experts, tokens, weights = [0, 1], [0, 1], [1.0, 0.5]
    got = pairs_of(module, recs, x, int8=int8, experts=experts, tokens=tokens, weights=weights)
    want = expected(recs, x, int8=int8 and module.VNNI, experts=experts, tokens=tokens, weights=weights)
    assert torch.isfinite(got).all() and all(w.abs().max() > 1e-3 for w in want)
    assert worst(got, want) < TOLERANCE


@pytest.mark.parametrize("int8", [False, True])
def test_a_scale_of_255_never_gives_a_finite_row(module, int8):
    """255 is NaN in E8M0 (convert refuses it: tests/models/test_mxfp4_records.py); a record that holds
    it anyway gives rows that are not finite, as the reference's do, never a plausible number."""
    recs = records(192, 96, "silu", n=1, seed=5)
    rec = recs[0][0]
    rec["down_proj.scales"][7, 2] = mxfp4.NAN_SCALE
    x = torch.randn(1, 192, generator=torch.Generator().manual_seed(9))
    got = pairs_of(module, recs, x, int8=int8, experts=[0], tokens=[0], weights=[1.0])
    ref = expected(recs, x, int8=False, dtype=torch.float32, experts=[0], tokens=[0], weights=[1.0])[0]
    assert not torch.isfinite(ref[7]) and not torch.isfinite(got[0, 7])
    assert torch.isfinite(got[0, :7]).all() and torch.isfinite(got[0, 8:]).all()  # the other rows as they were


E, H, INTER = 12, 576, 320


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
@pytest.mark.parametrize("T", [1, 5, 70])
def test_native_plan_matches_the_dequantized_reference(T, activation, float_activations):
    """One token, a few, and a prefill chunk's many (several token tiles and token blocks per expert)."""
    pool, fields, quant, slot_of = build_pool(E, H, INTER, extra_slots=3, seed=T, mx_spread=3, **ACTIVATIONS[activation])
    layout = native_layout(fields, quant)
    assert layout is not None, native.reason()
    x, ids, weights = routing_for(T, seed=T)
    plan = NativePlan(x, ids, weights, layout, threads=2)
    plan.run_table(pool, table_of(slot_of))
    want = reference_moe(x, pool, fields, quant, ids, weights, slot_of)
    assert (plan.finish() - want).abs().max().item() / want.abs().max().item() < TOLERANCE


def routing_for(T, seed):
    """test_native_plan's routing at this file's hidden size."""
    _, ids, weights = routing(T, seed)
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)), ids, weights


@pytest.mark.parametrize("int8", [False, True])
def test_a_tokens_bits_alone_in_batches_and_on_any_team(int8):
    """step(T) gives each token the bits of its own step, in batches of experts and on teams of 1 to 3."""
    pool, fields, quant, slot_of = build_pool(E, H, INTER, extra_slots=2, seed=3, mx_spread=3,
                                              **ACTIVATIONS["clamped_swiglu"])
    layout = native.layout(fields, quant, int8_activations=int8)
    x, ids, weights = routing_for(40, seed=9)
    whole = NativePlan(x, ids, weights, layout, threads=2)
    whole.run_table(pool, table_of(slot_of))
    together = whole.finish()
    experts = torch.unique(ids).tolist()
    for threads in (1, 3):
        batched = NativePlan(x, ids, weights, layout, threads=threads)
        for i in range(0, len(experts), 5):
            batch = experts[i:i + 5]
            batched.run(pool, batch, [slot_of[e] for e in batch])
        assert torch.equal(batched.finish(), together), threads
    for t in (0, 1, 13, 39):
        alone = NativePlan(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], layout, threads=1)
        alone.run_table(pool, table_of(slot_of))
        assert torch.equal(alone.finish()[0], together[t]), t


def test_mxfp4_layouts_the_native_kernels_refuse():
    recs = records(128, 64, "clamped_swiglu", n=1)
    rec, quant = recs[0]
    fields = native.record_blob(rec)[1]
    assert native.refusal(fields, quant) is None

    def refusal(change=None, **quant_change):
        fs = native.record_blob({**rec, **(change or {})})[1]
        return native.refusal(fs, {p: dataclasses.replace(q, **quant_change) for p, q in quant.items()})

    assert "MXFP4 needs bits 4 and group size 32" in refusal(group_size=64)
    assert "quant modes ['affine', 'mxfp4']" in native.refusal(fields, {**quant, "down_proj": dataclasses.replace(
        quant["down_proj"], mode="affine")})
    assert "dtypes other than U8" in refusal({"up_proj.scales": rec["up_proj.scales"].to(torch.bfloat16)})
    assert "down_proj.weight: shape [128, 64]" in refusal({"down_proj.weight": torch.zeros(128, 64, dtype=torch.uint8),
                                                          "down_proj.scales": torch.zeros(128, 4, dtype=torch.uint8)})
    assert "no down_proj.bias" in native.refusal([f for f in fields if f.name != "down_proj.bias"], quant)
    assert "an MXFP4 projection needs gate_proj.weight and gate_proj.scales" in native.refusal(
        [f for f in fields if f.name != "gate_proj.scales"], quant)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_routed_experts_take_the_native_kernels_for_mxfp4_records(activation):
    _, fields, quant, _ = build_pool(2, H, INTER, mx_spread=3, **ACTIVATIONS[activation])
    assert plan_kind(Pool(fields, quant)) is NativePlan


def test_the_cpu_shares_worker_serves_mxfp4_records():
    """A GPU's CPU share (the worker loop over a mailbox, played here by tensors) computes a layer of
    MXFP4 records: the withheld pairs come back as the direct call's rows."""
    recs = records(192, 96, "clamped_swiglu", n=3, seed=11)
    blobs = [native.record_blob(r) for r, _ in recs]
    layout = native.layout(blobs[0][1], recs[0][1])
    layouts = torch.zeros((2, native.LAYOUT_LEN), dtype=torch.int64)
    layouts[1] = layout
    addresses = torch.zeros((2, 3), dtype=torch.int64)
    addresses[1] = torch.tensor([b.data_ptr() for b, _ in blobs])
    box = SimpleNamespace(header=torch.zeros(5, dtype=torch.int64), x_in=torch.randn(4, 192).bfloat16(),
                          ids_in=torch.zeros(16, dtype=torch.int32), w_in=torch.zeros(16),
                          mask_in=torch.zeros(16, dtype=torch.int8), rows_out=torch.full((16, 192), float("nan")),
                          ack=torch.zeros(1, dtype=torch.int64))
    worker = NativeWorker(box, layouts, addresses, threads=2, busy_s=0.005, idle_sleep_s=0.0002, host_pool=torch.zeros(1))
    try:
        m = SimpleNamespace(box=box, seq=0)
        assert post(m, 1, 2, [0, 2, 1, 2], [0.5, 0.25, 1.5, -0.75], [1, 0, 1, 1]) == 1
        expect = torch.empty(3, 192)
        native.weighted_rows(native.load(), layout, [b for b, _ in blobs], [0, 1, 2], [0, 1, 1], [0.5, 1.5, -0.75],
                             box.x_in[:2].float(), expect, threads=1)
        assert torch.equal(box.rows_out[[0, 2, 3]], expect) and box.rows_out[1].isnan().all()
        assert worker.count()["errors"] == 0
    finally:
        worker.close()
