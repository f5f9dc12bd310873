"""The kernels that end one decoder layer and begin the next (the decoder's fused boundaries,
moestream.engine.decoder.Decoder._boundaries) under Triton's CPU interpreter (TRITON_INTERPRET=1), at
odd sizes: add_rms_norm's float32 split copy of hn is the gemv expert kernels' input, bit for bit,
and a plan that reads it gives the bits of one that copies x itself; route_rows gives the router
product's logits and route_topk's choice in one kernel; MoEPlan.finish with a norm
writes the expert sum (+ residual) with finish's bits and the next layer's input norm with
triton_decode.rms_norm's; DecoderLayer.attention_rows given both gives the bits it gives alone.

Runs in the interpreter's own stage (tests/interpret/interpreter.py). Float32 is checked for equal bits, bfloat16 loosely where torch's ops are the reference
(the interpreter truncates float32 -> bfloat16 where the GPU rounds); tests/gpu/test_fused_boundaries_cuda.py
checks the GPU and the decoder."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter import gen, interpreted_module, randn, relative_error  # noqa: E402

from kernel_helpers import build_pool, reference_moe  # noqa: E402
from moestream.kernels.expert_layout import KernelConfig, SlotLayout  # noqa: E402
from moestream.layers.norm import rms_norm as torch_rms_norm  # noqa: E402

EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 4e-2}  # max |y - ref| / max |ref|
E, I, A = 6, 64, 3
FAST = KernelConfig(gemv_gate_up_n=64, gemv_down_n=128, combine_tokens=2, combine_block=64)


@pytest.fixture(scope="module")
def td():
    return interpreted_module("moestream.kernels.triton_decode")


@pytest.fixture(scope="module")
def tm():
    return interpreted_module("moestream.kernels.triton_moe")


def split_of(hn: torch.Tensor, c: int) -> torch.Tensor:
    """hn [T, N] in the gemv kernels' input order [T, c, N/c], float32 (the plan's own copy)."""
    T, N = hn.shape
    return hn.float().view(T, N // c, c).transpose(1, 2).contiguous()


# -- add_rms_norm's split copy -------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N,C", [(1, 192, 8), (3, 96, 8), (5, 200, 4)])
def test_add_rms_norm_writes_the_split_expert_input(td, T, N, C, dtype):
    g = gen(T * N + C)
    x = randn(T, N + 16, g=g, dtype=dtype)[:, 16:]  # strided rows
    y, w = randn(T, N, g=g, dtype=dtype), randn(N, g=g, dtype=dtype)
    h_ref, hn_ref = td.add_rms_norm(x, y, w, EPS)
    split = torch.full((T, C, N // C), 7.0)
    h, hn = td.add_rms_norm(x, y, w, EPS, split=split)
    assert torch.equal(h, h_ref) and torch.equal(hn, hn_ref)  # the split changes nothing else
    assert torch.equal(split, split_of(hn, C))
    assert relative_error(hn, torch_rms_norm(x + y, w, EPS)) < TOL[dtype]


def test_a_bad_split_is_refused(td):
    x = torch.zeros(2, 64)
    for bad in (torch.zeros(2, 8, 7), torch.zeros(3, 8, 8), torch.zeros(2, 8, 8, dtype=torch.bfloat16),
                torch.zeros(2, 8, 8).transpose(1, 2)):
        with pytest.raises(ValueError, match="split"):
            td.add_rms_norm(x, x, torch.ones(64), EPS, split=bad)


# -- the router product with its top-k ------------------------------------------------------------------

@pytest.fixture(scope="module")
def troute():
    return interpreted_module("moestream.kernels.triton_route")


SPLIT = KernelConfig(rows_narrow_n=16, rows_narrow_k=16, rows_narrow_split=4)  # K in 4 splits where it divides


@pytest.mark.parametrize("split", [False, True], ids=["whole", "split"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("R,E,K,k", [(16, 40, 100, 4), (5, 128, 64, 8), (16, 8, 48, 2), (1, 60, 200, 6)])
def test_the_router_product_with_its_top_k(troute, R, E, K, k, dtype, split):
    """route_rows: tile_linear's logits (the same bits), then route_topk's choice and weights (with
    per-expert scales too); the
    counter back at zero after every launch, so the next launch (or a graph's replay) counts anew."""
    tr = interpreted_module("moestream.kernels.triton_rows")
    g = gen(R * E + K)
    x = randn(R, K + 8, g=g, dtype=dtype)[:, 8:]  # strided rows
    router = randn(E, K, g=g, dtype=dtype)
    counter = torch.zeros(1, dtype=torch.int32)
    cfg = SPLIT if split else KernelConfig()
    if split and K % 64 == 0:
        assert tr.tile(E, K, dtype, cfg)["SPLIT"] == 4
    scales = randn(E, g=g, dtype=dtype).abs() + 0.5  # per-expert scales of the weights (Gemma 4)
    for normalize, scale in ((True, None), (False, None), (True, scales)):
        for out_dtype in (dtype, torch.float32):
            w_ref, ids_ref = troute.route_topk(tr.tile_linear(x, router, config=cfg), k, normalize=normalize,
                                               out_dtype=out_dtype, expert_scale=scale)
            w, ids = troute.route_rows(x, router, k, normalize=normalize, out_dtype=out_dtype, counter=counter,
                                       config=cfg, expert_scale=scale)
            assert int(counter) == 0
            assert w.dtype == out_dtype and w.shape == ids.shape == (R, k) and ids.dtype == torch.int64
            assert torch.equal(ids, ids_ref)
            assert torch.allclose(w.float(), w_ref.float(), rtol=1e-6, atol=0)
            again = troute.route_rows(x, router, k, normalize=normalize, out_dtype=out_dtype, counter=counter,
                                      config=cfg, expert_scale=scale)
            assert torch.equal(again[0], w) and torch.equal(again[1], ids)
    some = min(3, R)  # a step's real rows: theirs routed with the same bits, the tile's others zeros
    w, ids = troute.route_rows(x, router, k, normalize=False, out_dtype=dtype, counter=counter, config=cfg)
    w_some, ids_some = troute.route_rows(x, router, k, normalize=False, out_dtype=dtype, counter=counter, rows=some,
                                         config=cfg)
    assert torch.equal(w_some[:some], w[:some]) and torch.equal(ids_some[:some], ids[:some])
    assert not w_some[some:].any() and not ids_some[some:].any() and int(counter) == 0


def test_route_rows_refuses_what_it_cannot_take(troute):
    x, router = torch.zeros(4, 32), torch.zeros(16, 32)
    counter = torch.zeros(1, dtype=torch.int32)
    for kw in (dict(counter=torch.zeros(1, dtype=torch.int64)), dict(counter=torch.zeros(2, dtype=torch.int32))):
        with pytest.raises(ValueError, match="counter"):
            troute.route_rows(x, router, 2, normalize=True, out_dtype=torch.float32, **kw)
    for args in ((x, torch.zeros(16, 31)), (x, router.double()), (torch.zeros(4, 32), torch.zeros(2000, 32)),
                 (torch.zeros(65, 32), router)):
        with pytest.raises(ValueError):
            troute.route_rows(*args, 2, normalize=True, out_dtype=torch.float32, counter=counter)
    with pytest.raises(ValueError, match="rows"):
        troute.route_rows(x, router, 2, normalize=True, out_dtype=torch.float32, counter=counter, rows=5)


def test_a_moe_block_routes_through_the_fused_kernel_where_it_can(troute):
    """MoEBlock.route(fused=...): the kernel for models.base's softmax router, with the choice the
    block's own route gives; not for another routing function or a router bias."""
    from types import SimpleNamespace

    from moestream.layers.moe import MoEBlock
    from moestream.models.base import softmax_router

    g = gen(9)
    H, E, k = 64, 24, 4
    x, router = randn(16, H, g=g), randn(E, H, g=g)
    route = softmax_router(SimpleNamespace(num_experts_per_tok=k), normalize=True)
    block = MoEBlock(3, router, route, SimpleNamespace(reroute=None), top_k=k)
    calls = []

    def fused(*args, **kw):
        calls.append(kw)
        return troute.route_rows(*args, **kw, counter=torch.zeros(1, dtype=torch.int32))

    assert block.fuses(torch.float32, 256) and not block.fuses(torch.bfloat16) and not block.fuses(torch.float32, 16)
    w, ids = block.route(x, fused=fused)
    w_ref, ids_ref = block.route(x)
    assert calls == [dict(normalize=True, out_dtype=torch.float32)]
    assert torch.equal(ids, ids_ref) and relative_error(w, w_ref) < TOL[torch.float32]  # F.linear, torch top-k
    other = MoEBlock(3, router, lambda logits: route(logits), SimpleNamespace(reroute=None), top_k=k)
    biased = MoEBlock(3, router, route, SimpleNamespace(reroute=None), top_k=k, router_bias=torch.zeros(E))
    for b in (other, biased):
        assert not b.fuses(torch.float32)
        assert torch.equal(b.route(x, fused=fused)[1], ids_ref) and len(calls) == 1


# -- the experts' ends -----------------------------------------------------------------------------------

def plan_for(tm, pool_set, x, ids, weights, **kw):
    pool, fields, quant, slot_of = pool_set
    plan = tm.MoEPlan(x, ids, weights, E, SlotLayout.from_fields(fields, quant), mode="gemv", config=FAST, **kw)
    plan.run_table(pool, torch.tensor(slot_of, dtype=torch.int32))
    return plan


def routed(T, H, dtype, seed):
    g = gen(seed)
    x = randn(T, H, g=g, dtype=dtype)
    ids = torch.rand(T, E, generator=g).topk(A, dim=-1).indices
    weights = torch.softmax(torch.randn(T, A, generator=g), dim=-1).to(dtype)
    return x, ids, weights


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("T,H", [(1, 192), (3, 128)])
def test_a_plan_reading_the_split_input_gives_the_bits_of_its_own_copy(tm, T, H, bits):
    pool_set = build_pool(E, H, I, bits=bits, extra_slots=2, seed=bits)
    x, ids, weights = routed(T, H, torch.bfloat16, seed=T + H)
    own = plan_for(tm, pool_set, x, ids, weights)
    shape = tm.split_shape(own.layout, T)
    assert shape == (T, 32 // bits, H * bits // 32)
    given = plan_for(tm, pool_set, x, ids, weights, split_x=split_of(x, shape[1]))
    assert torch.equal(given.finish(), own.finish())
    ref = reference_moe(x, *pool_set[:3], ids, weights, pool_set[3], dtype=torch.float64)
    assert relative_error(given.finish(), ref) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="split_x"):
        plan_for(tm, pool_set, x, ids, weights, split_x=torch.zeros(T, 4, H // 4 + 1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,H", [(1, 192), (5, 128)])
def test_finish_with_the_next_norm(tm, td, T, H, dtype):
    pool_set = build_pool(E, H, I, bits=4, extra_slots=2, seed=H)
    x, ids, weights = routed(T, H, dtype, seed=11 * T)
    g = gen(T + 1)
    residual, w = randn(T, H, g=g, dtype=dtype), 1 + randn(H, g=g, dtype=dtype) / 4
    plan = plan_for(tm, pool_set, x, ids, weights)
    for res in (residual, None):
        y_ref = plan.finish(res)
        y, normed = torch.full((T, H), 3.0, dtype=dtype), torch.full((T, H), 5.0, dtype=dtype)
        assert plan.finish(res, out=y, norm=(w, EPS, normed)) is y
        assert torch.equal(y, y_ref)  # the expert sum's bits are finish's
        assert torch.equal(normed, td.rms_norm(y, w, EPS))  # the norm's are rms_norm's
        assert relative_error(normed, torch_rms_norm(y, w, EPS)) < TOL[dtype]
    bad = torch.zeros(T + 1, H, dtype=dtype)
    with pytest.raises(ValueError, match="normed"):
        plan.finish(residual, norm=(w, EPS, bad))
    with pytest.raises(ValueError, match="norm weight"):
        plan.finish(residual, norm=(w[1:], EPS, torch.zeros(T, H, dtype=dtype)))


def test_a_decoder_layer_given_its_normed_input_and_split_gives_the_same_bits(td):
    """DecoderLayer.attention_rows with `normed` (its input norm, computed by the caller) and `split`:
    the (h, hn) it computes without the split, and the split copy of hn; rows_input_norm names that norm."""
    from moestream.layers.attention import Attention, AttentionWeights
    from moestream.kv.layout import LayerKV
    from tests.paged import pool_for
    from moestream.layers.rope import Rope
    from moestream.layers.transformer import DecoderLayer

    H, Nq, Nkv, D, R, T = 96, 4, 2, 16, 16, 3
    g = gen(5)
    aw = AttentionWeights(q=randn(Nq * D, H, g=g) / 8, k=randn(Nkv * D, H, g=g) / 8, v=randn(Nkv * D, H, g=g) / 8,
                          o=randn(H, Nq * D, g=g) / 8, q_norm=1 + randn(D, g=g) / 4, k_norm=1 + randn(D, g=g) / 4)
    aw.fuse_qkv()
    attn = Attention(aw, Rope(D, 1e6, torch.device("cpu")), num_heads=Nq, num_kv_heads=Nkv, head_dim=D,
                     qk_norm="head", eps=EPS)
    layer = DecoderLayer(attn, None, 1 + randn(H, g=g) / 4, 1 + randn(H, g=g) / 4, EPS)
    caches = [pool_for([LayerKV(Nkv, D)] * 2, context=32, block_size=4) for _ in range(2)]
    for pool in caches:
        pool.sequences[0].reserve(4, 4 + T)
    x = randn(R, H, g=g)
    pos = torch.zeros(R, dtype=torch.long)
    pos[:T] = torch.arange(4, 4 + T)
    weight, eps = layer.rows_input_norm()
    assert weight is layer.input_norm and eps == EPS
    seqs = torch.zeros(T, dtype=torch.long)
    h_ref, hn_ref = layer.attention_rows(x, pos[:T], seqs, caches[0].layer(1), normed=td.rms_norm(x, weight, eps))
    split = torch.zeros(R, 8, H // 8)
    h, hn = layer.attention_rows(x, pos[:T], seqs, caches[1].layer(1), normed=td.rms_norm(x, weight, eps),
                                 split=split)
    assert torch.equal(h, h_ref) and torch.equal(hn, hn_ref)
    assert torch.equal(split, split_of(hn, 8))
    assert torch.equal(caches[0].layer(1).keys, caches[1].layer(1).keys)
    assert torch.equal(caches[0].layer(1).values, caches[1].layer(1).values)
