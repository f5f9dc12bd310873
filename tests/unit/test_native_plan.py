"""The CPU's routed experts from the native kernels (NativePlan) against the dequantized torch
reference (TorchPlan) on the same slot pool: within float32 rounding on the float rows (int8
activations where the CPU has VNNI: within their bound of the float rows), and the same bits however the
experts are batched, whatever tokens sit beside a pair and on any team; RoutedExperts takes it where
the native kernels take the records, and the torch reference where they do not or where no build exists."""
import pytest
import torch

from moestream.cpu_share import kernels as native
from moestream.layers import native_experts
from moestream.layers.experts import RoutedExperts
from moestream.layers.native_experts import NativePlan, native_layout
from moestream.layers.torch_experts import TorchPlan
from tests.kernel_helpers import build_pool, reference_moe

E, H, INTER, A = 12, 256, 128, 4
# float32 rounding of sums over a few hundred products, relative to the output's largest entry; the
# int8-activation rows (moestream.cpu_share.native/int8_rows.h) land near 1e-2 and fail it
TOLERANCE = 5e-6


def routing(T: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)])
    weights = torch.softmax(torch.randn(T, A, generator=g), dim=-1)
    return x, ids, weights


def table_of(slot_of: list[int]) -> torch.Tensor:
    return torch.tensor(slot_of, dtype=torch.int32)


@pytest.mark.parametrize("bits,down_bits", [(4, 4), (8, 8), (4, 8)])
@pytest.mark.parametrize("T", [1, 5])
def test_native_plan_matches_the_dequantized_reference(bits, down_bits, T, float_activations):
    pool, fields, quant, slot_of = build_pool(E, H, INTER, bits=bits, down_bits=down_bits, extra_slots=3, seed=bits)
    layout = native_layout(fields, quant)
    assert layout is not None, native.reason()
    x, ids, weights = routing(T, seed=T)
    residual = torch.randn(T, H)
    plan = NativePlan(x, ids, weights, layout, threads=1)
    plan.run_table(pool, table_of(slot_of))
    got = plan.finish(residual)
    expected = reference_moe(x, pool, fields, quant, ids, weights, slot_of) + residual
    error = (got - expected).abs().max().item() / (expected - residual).abs().max().item()
    assert error < TOLERANCE, error


def test_int8_activations_where_the_cpu_has_vnni_near_the_float_rows():
    """The CPU device's experts take the rows `native.activations()` names: int8 where the CPU has
    VNNI, within the int8 rows' bound of the float ones (tests/unit/test_native_int8.py)."""
    pool, fields, quant, slot_of = build_pool(E, H, INTER, seed=7)
    layout = native_layout(fields, quant)
    assert int(layout[native.INT8_ACTS]) == int(native.activations() == "int8")
    x, ids, weights = routing(5, seed=2)
    outputs = []
    for lay in (layout, native.layout(fields, quant, int8_activations=False)):
        plan = NativePlan(x, ids, weights, lay, threads=1)
        plan.run_table(pool, table_of(slot_of))
        outputs.append(plan.finish())
    error = ((outputs[0] - outputs[1]).norm() / outputs[1].norm()).item()
    assert (1e-4 < error < 3e-2) if native.vnni() else error == 0, error


def test_the_same_bits_in_batches_alone_and_on_any_team():
    """A pair's row never depends on the experts computed with it, the tokens beside it or the team."""
    pool, fields, quant, slot_of = build_pool(E, H, INTER, extra_slots=2, seed=3)
    layout = native_layout(fields, quant)
    x, ids, weights = routing(6, seed=9)
    whole = NativePlan(x, ids, weights, layout, threads=1)
    whole.run_table(pool, table_of(slot_of))
    expected = whole.finish()
    experts = torch.unique(ids).tolist()
    for threads in (1, 2, 3):
        batched = NativePlan(x, ids, weights, layout, threads=threads)
        for i in range(0, len(experts), 5):  # as RoutedExperts runs more experts than the pool pins at once
            batch = experts[i:i + 5]
            batched.run(pool, batch, [slot_of[e] for e in batch])
        assert torch.equal(batched.finish(), expected), threads
    for t in range(6):  # each token alone
        alone = NativePlan(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], layout, threads=2)
        alone.run_table(pool, table_of(slot_of))
        assert torch.equal(alone.finish()[0], expected[t]), t


@pytest.mark.parametrize("bits,down_bits", [(4, 4), (8, 8)])
def test_a_prefill_chunks_pairs_have_their_bits_alone(bits, down_bits, float_activations):
    """Many pairs per expert (tiles of tokens, several token blocks and a remainder): each token's
    output has the bits it has alone, and stays within float32 rounding of the reference."""
    pool, fields, quant, slot_of = build_pool(E, H, INTER, bits=bits, down_bits=down_bits, seed=5)
    layout = native_layout(fields, quant)
    x, ids, weights = routing(70, seed=11)  # ~23 pairs per expert
    chunk = NativePlan(x, ids, weights, layout, threads=2)
    chunk.run_table(pool, table_of(slot_of))
    together = chunk.finish()
    expected = reference_moe(x, pool, fields, quant, ids, weights, slot_of)
    assert (together - expected).abs().max().item() / expected.abs().max().item() < TOLERANCE
    for t in (0, 1, 17, 42, 69):
        alone = NativePlan(x[t:t + 1], ids[t:t + 1], weights[t:t + 1], layout, threads=1)
        alone.run_table(pool, table_of(slot_of))
        assert torch.equal(alone.finish()[0], together[t]), t


class Pool:
    """The ExpertProvider calls RoutedExperts makes when it is built."""

    def __init__(self, fields, quant):
        self.fields, self.quant_ = fields, quant

    def record_fields(self, layer):
        return self.fields

    def quant(self, layer):
        return self.quant_


def plan_kind(provider) -> type:
    experts = RoutedExperts(provider, {0: E}, device=torch.device("cpu"))
    x, ids, weights = routing(1, seed=0)
    return type(experts.plan(0, x, ids, weights, per_pair=True))


def test_routed_experts_take_the_native_kernels_where_they_compute_the_records(monkeypatch):
    _, fields, quant, _ = build_pool(2, H, INTER)
    assert plan_kind(Pool(fields, quant)) is NativePlan
    _, gelu_fields, gelu_quant, _ = build_pool(2, H, INTER, activation="gelu_tanh")
    assert plan_kind(Pool(gelu_fields, gelu_quant)) is TorchPlan  # a layout the native kernels refuse
    monkeypatch.setattr(native, "_state", {"reason": "no compiler here"})  # no build: the float path
    assert native_experts.native_layout(fields, quant) is None
    assert plan_kind(Pool(fields, quant)) is TorchPlan
