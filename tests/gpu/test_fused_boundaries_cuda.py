"""The decoder's fused layer boundaries on CUDA (moestream.engine.decoder.Decoder._boundaries): the
kernels at the Qwen3-30B-A3B shape (add_rms_norm's split copy is the experts' own input bit for bit;
the expert sum with the next norm gives finish's bits and rms_norm's up to the float32 summation
order), and the decoder with them: the greedy tokens and logits of the unfused step in float32,
the same bits for every cache size, a step of T tokens the bits of T one-token steps."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from kernel_helpers import build_pool  # noqa: E402
from moestream.engine.engine import Engine  # noqa: E402
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.kernels import triton_decode as td  # noqa: E402
from moestream.kernels import triton_moe as tm  # noqa: E402
from moestream.kernels.expert_layout import SlotLayout  # noqa: E402

from batching_helpers import greedy_rows  # noqa: E402

DEV = "cuda"
H, I, E, A, R = 2048, 768, 16, 8, 16  # the 30B shape's hidden, expert intermediate and top-k; the step's tile
EPS = 1e-6


def randn(*shape, seed, dtype=torch.bfloat16):
    return torch.randn(*shape, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(dtype)


def relative_error(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def assert_norm_bits_up_to_sum_order(y, ref):
    """rms_norm's arithmetic, the float32 sum of squares perhaps in another order: an ulp of rstd
    rarely moves a bf16 result, and then by an ulp (two after the weight)."""
    assert ((y.float() - ref.float()).abs() <= ref.float().abs() * 2.0 ** -6).all()
    assert (y == ref).float().mean() >= 0.999


def test_the_split_copy_is_the_experts_input_and_changes_no_bits():
    x, y, w = randn(R, H, seed=1), randn(R, H, seed=2), 1 + randn(H, seed=3) / 4
    pool, fields, quant, slot_of = build_pool(E, H, I, bits=4, device=DEV)
    layout = SlotLayout.from_fields(fields, quant)
    split = torch.zeros(tm.split_shape(layout, R), dtype=torch.float32, device=DEV)
    h_ref, hn_ref = td.add_rms_norm(x, y, w, EPS)
    h, hn = td.add_rms_norm(x, y, w, EPS, split=split)
    assert torch.equal(h, h_ref)
    assert_norm_bits_up_to_sum_order(hn, hn_ref)  # (the same code; a compiler's other layout could reorder the sum)
    assert torch.equal(split, hn.float().view(R, H // 8, 8).transpose(1, 2))
    table = torch.tensor(slot_of, dtype=torch.int32, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(4)
    for T in (1, 3):
        ids = torch.rand(T, E, generator=g, device=DEV).topk(A, dim=-1).indices
        weights = torch.softmax(torch.randn(T, A, generator=g, device=DEV), -1).to(torch.bfloat16)
        outs = []
        for given in (None, split[:T]):
            plan = tm.MoEPlan(hn[:T], ids, weights, E, layout, mode="gemv", split_x=given)
            plan.run_table(pool, table)
            outs.append(plan.finish(h[:T]))
        assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("T", [1, 5])
def test_the_expert_sum_with_the_next_norm(T):
    pool, fields, quant, slot_of = build_pool(E, H, I, bits=4, device=DEV)
    layout = SlotLayout.from_fields(fields, quant)
    x, residual, w = randn(T, H, seed=T), randn(T, H, seed=10 + T), 1 + randn(H, seed=20) / 4
    g = torch.Generator(device=DEV).manual_seed(T)
    ids = torch.rand(T, E, generator=g, device=DEV).topk(A, dim=-1).indices
    weights = torch.softmax(torch.randn(T, A, generator=g, device=DEV), -1).to(torch.bfloat16)
    plan = tm.MoEPlan(x, ids, weights, E, layout, mode="gemv")
    plan.run_table(pool, torch.tensor(slot_of, dtype=torch.int32, device=DEV))
    y_ref = plan.finish(residual)
    y, normed = torch.empty_like(x), torch.empty_like(x)
    plan.finish(residual, out=y, norm=(w, EPS, normed))
    assert torch.equal(y, y_ref)
    assert_norm_bits_up_to_sum_order(normed, td.rms_norm(y, w, EPS))
    again = torch.empty_like(x)
    plan.finish(residual, out=y, norm=(w, EPS, again))
    assert torch.equal(again, normed)  # run to run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_the_router_product_with_its_top_k_in_a_replayed_graph(dtype):
    """route_rows at the 30B router (128 experts, top 8, 16-row tile): route_topk's choice of
    tile_linear's logits, the weights within a float32 ulp or two; 64 launches captured in one graph
    and replayed give the same every time (the counter that finds the last program is back at zero
    after each launch), for one real row and for all 16."""
    from moestream.kernels.triton_route import route_rows, route_topk
    from moestream.kernels.triton_rows import tile_linear

    experts, k = 128, 8
    x, router = randn(R, H, seed=30, dtype=dtype), randn(experts, H, seed=31, dtype=dtype) / 16
    w_ref, ids_ref = route_topk(tile_linear(x, router), k, normalize=True, out_dtype=dtype)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    for rows in (R, 1):
        w, ids = route_rows(x, router, k, normalize=True, out_dtype=dtype, counter=counter, rows=rows)
        assert torch.equal(ids[:rows], ids_ref[:rows]) and not ids[rows:].any()
        assert relative_error(w[:rows], w_ref[:rows]) < (1e-6 if dtype == torch.float32 else 1e-2)
        outs = []
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        # thread_local: a thread an earlier test left (an engine's reader) must not void this capture
        with torch.cuda.graph(graph, stream=stream, capture_error_mode="thread_local"):
            for _ in range(64):
                outs.append(route_rows(x, router, k, normalize=True, out_dtype=dtype, counter=counter, rows=rows))
        for _ in range(3):
            graph.replay()
            torch.cuda.synchronize()
            assert int(counter) == 0
            for got_w, got_ids in outs:
                assert torch.equal(got_ids, ids) and torch.equal(got_w, w)


def load(packed, *, graphs=True, **opts):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "max_context": 256, **opts}), graphs=graphs)


def greedy(engine, prompt, n=16):
    return greedy_rows(engine, prompt, n)


def unfused(engine):
    """The engine's decoder with each boundary kernel on its own (the step before the fusion: the reference)."""
    engine.decoder._boundaries(False)
    d = engine.decoder
    assert not d.graphs and not d.norm_after and not d.split_in and not d.fused_route
    return engine


def test_the_fused_step_gives_the_unfused_tokens_and_logits(tiny_packed_model):
    # bfloat16: the Triton expert kernels (and so the fused boundaries) take 16-bit activations only
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    runs = {}
    for fused in (True, False):
        engine = load(packed, dtype="bfloat16", cache_size="all")
        try:
            d = engine.decoder
            moe = sorted(d.routed)
            if fused:  # every MoE layer's boundary fused, the last one's next norm excepted (the head's)
                assert d.rows_at_once and sorted(d.split_in) == moe and sorted(d.fused_route) == moe
                assert sorted(d.norm_after) == [i for i in moe if i + 1 < len(engine.model.layers)]
            else:
                unfused(engine)
            prompt = [t % engine.args.vocab_size for t in range(5, 60)]
            runs[fused] = greedy(engine, prompt)
            assert ("step", 1) in engine.decoder.graphs
        finally:
            engine.close()
    (tokens, rows), (ref_tokens, ref_rows) = runs[True], runs[False]
    assert tokens == ref_tokens
    # the norms' float32 sums in another order, rounded to bfloat16
    assert max(relative_error(a, b) for a, b in zip(rows, ref_rows)) < 2e-2


def test_the_fused_step_gives_the_same_bits_for_every_cache_size(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    runs = []
    for size, graphs in (("all", True), ("50%", True), ("min", False)):
        engine = load(packed, dtype="bfloat16", cache_size=size, graphs=graphs)
        try:
            assert engine.decoder.norm_after
            prompt = [t % engine.args.vocab_size for t in range(7, 90)]
            runs.append(greedy(engine, prompt, n=12))
            engine.reset()
            engine.prefill(prompt)
            many = engine.step(runs[-1][0][:4])  # four rows at once: each the bits of its one-token step
            assert all(torch.equal(many[t], runs[-1][1][t]) for t in range(4))
        finally:
            engine.close()
    for tokens, rows in runs[1:]:
        assert tokens == runs[0][0]
        assert all(torch.equal(a, b) for a, b in zip(rows, runs[0][1]))
