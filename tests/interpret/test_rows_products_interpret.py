"""The row tile's product kernel (moestream.kernels.triton_rows) under Triton's
CPU interpreter (TRITON_INTERPRET=1), at tiny sizes: it agrees with a float64 product on odd shapes
(N and K not multiples of the blocks, strided rows, a bias), a row's bits never depend on the rows
beside it or on how many rows there are, and the rows-at-once layers (Attention.forward, the router,
the shared expert, the head) give F.linear's results with it.

Runs in the interpreter's own stage (tests/interpret/interpreter.py). Float32 is checked tightly, bfloat16 loosely (the interpreter truncates float32 ->
bfloat16 where the GPU rounds); tests/gpu/test_rows_products_cuda.py checks the GPU."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from interpreter import gen, interpreted_module, randn, relative_error  # noqa: E402
from moestream.kernels.expert_layout import KernelConfig  # noqa: E402
from moestream.layers.attention import Attention, AttentionWeights  # noqa: E402
from moestream.kv.layout import LayerKV  # noqa: E402
from tests.paged import pool_for  # noqa: E402
from moestream.layers.rope import Rope  # noqa: E402

EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # max |y - ref| / max |ref|
# small blocks, so a tiny product takes several programs and several steps of K
SMALL = KernelConfig(rows_n=16, rows_k=32, rows_swap=0, rows_narrow_max=24, rows_narrow_n=16, rows_narrow_k=64,
                     rows_narrow_split=1)
CONFIGS = {"default": KernelConfig(), "small": SMALL,
           "swap": KernelConfig(rows_n=32, rows_k=64, rows_swap=1, rows_narrow_n=32, rows_narrow_k=64, rows_narrow_swap=1,
                                rows_narrow_split=1),
           "wide": KernelConfig(rows_n=64, rows_k=128, rows_warps=8, rows_stages=2, rows_swap=0, rows_narrow_max=8),
           # K split in 2 (wide) and 4 (narrow): partials added by each column block's last program
           "split": KernelConfig(rows_n=16, rows_k=16, rows_swap=0, rows_split=2, rows_narrow_max=24, rows_narrow_n=16,
                                 rows_narrow_k=16, rows_narrow_split=4),
           # the deep class (K >= 64 here) on its own sizes, split in 2, on the M side
           "deep": KernelConfig(rows_narrow_max=8, rows_deep_from=64, rows_deep_n=16, rows_deep_k=16, rows_deep_swap=1,
                                rows_deep_split=2, rows_n=16, rows_k=32, rows_swap=0)}


@pytest.fixture(scope="module")
def tr():
    return interpreted_module("moestream.kernels.triton_rows")


# -- the kernel -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", list(CONFIGS), ids=list(CONFIGS))
@pytest.mark.parametrize("R,N,K", [(16, 77, 100), (16, 40, 64), (5, 130, 48), (1, 16, 200), (16, 3, 37)])
def test_matches_a_float64_product(tr, R, N, K, config, dtype):
    g = gen(R * 1000 + N + K)
    x = randn(R, K + 8, g=g, dtype=dtype)[:, 8:]  # strided rows at an offset
    w = randn(N, K, g=g, dtype=dtype)
    b = randn(N, g=g, dtype=dtype)
    for bias in (None, b):
        y = tr.tile_linear(x, w, bias, config=CONFIGS[config])
        assert y.shape == (R, N) and y.dtype == dtype
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert relative_error(y, ref) < TOL[dtype]


def test_strided_weights_and_an_output_buffer(tr):
    g = gen(3)
    x, big = randn(16, 96, g=g), randn(50, 128, g=g)
    w = big[:, 16:112]  # rows of 128 elements, 96 used
    out = torch.full((16, 50), 7.0)
    assert tr.tile_linear(x, w, out=out, config=SMALL) is out
    assert relative_error(out, F.linear(x.double(), w.double())) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("config", ["default", "small", "swap", "split", "deep"])
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(tr, config, dtype):
    """The same row among other neighbours, at another place of the tile, or with fewer rows in
    the call: the same bits."""
    g = gen(5)
    N, K = 70, 150
    w, bias = randn(N, K, g=g, dtype=dtype), randn(N, g=g, dtype=dtype)
    x = randn(16, K, g=g, dtype=dtype)
    y = tr.tile_linear(x, w, bias, config=CONFIGS[config])
    other = randn(16, K, g=g, dtype=dtype) * 100
    for r in (0, 5, 15):
        mixed = other.clone()
        mixed[(r + 3) % 16] = x[r]
        assert torch.equal(tr.tile_linear(mixed, w, bias, config=CONFIGS[config])[(r + 3) % 16], y[r]), r
    for rows in (1, 3):
        assert torch.equal(tr.tile_linear(x[:rows], w, bias, config=CONFIGS[config]), y[:rows])


def test_bad_arguments_are_refused(tr):
    x, w = torch.zeros(16, 32), torch.zeros(8, 32)
    with pytest.raises(ValueError):
        tr.tile_linear(x, torch.zeros(8, 16))  # K differs
    with pytest.raises(ValueError):
        tr.tile_linear(x, w.to(torch.bfloat16))  # dtypes differ
    with pytest.raises(ValueError):
        tr.tile_linear(torch.zeros(tr.MAX_ROWS + 1, 32), w)
    with pytest.raises(ValueError):
        tr.tile_linear(x, torch.zeros(32, 8).t())  # a column-major weight
    with pytest.raises(ValueError):
        tr.tile_linear(x, w, torch.zeros(9))
    with pytest.raises(ValueError):
        tr.tile_linear(x, w, out=torch.zeros(16, 9))


def test_the_tile_follows_from_the_shape_and_the_config(tr):
    cfg = KernelConfig(rows_n=32, rows_k=256, rows_narrow_max=128, rows_narrow_n=16, rows_narrow_k=512)
    assert tr.tile(128, 2048, torch.bfloat16, cfg)["BN"] == 16 and tr.tile(128, 2048, torch.bfloat16, cfg)["BK"] == 512
    wide = tr.tile(5120, 2048, torch.bfloat16, cfg)
    assert wide["BN"] == 32 and wide["BK"] == 256 and wide["EVEN_K"]
    assert tr.tile(5120, 2048, torch.float32, cfg)["BK"] == 64  # an FMA dot's tiles stay small
    assert not tr.tile(5120, 100, torch.bfloat16, cfg)["EVEN_K"]


def test_the_split_follows_from_the_shape_and_the_config(tr):
    cfg = KernelConfig(rows_n=16, rows_k=256, rows_split=4, rows_split_below=1024, rows_narrow_n=16,
                       rows_narrow_k=256, rows_narrow_split=8, rows_deep_from=8192)
    assert tr.tile(2048, 4096, torch.bfloat16, cfg)["SPLIT"] == 4  # o: 128 column blocks
    assert tr.tile(128, 2048, torch.bfloat16, cfg)["SPLIT"] == 8  # a router: 2,048 = 8 x 256
    assert tr.tile(151936, 2048, torch.bfloat16, cfg)["SPLIT"] == 1  # a head: programs enough without
    assert tr.tile(2048, 512, torch.bfloat16, cfg)["SPLIT"] == 2  # K = 2 steps: 2 splits at most
    assert tr.tile(2048, 300, torch.bfloat16, cfg)["SPLIT"] == 1  # K not in whole steps
    deep = KernelConfig(rows_deep_from=4096, rows_deep_n=32, rows_deep_k=128, rows_deep_split=2, rows_deep_swap=0,
                        rows_n=64, rows_swap=1, rows_split=1)
    assert tr.row_class(2048, 4096, deep) == "deep" and tr.row_class(5120, 2048, deep) == "wide"
    assert tr.row_class(128, 8192, deep) == "narrow"
    assert tr.tile(2048, 4096, torch.bfloat16, deep) == dict(BN=32, BK=128, EVEN_K=True, SWAP=False, SPLIT=2,
                                                             num_warps=2, num_stages=4)
    assert tr.tile(5120, 2048, torch.bfloat16, deep)["BN"] == 64 and tr.tile(5120, 2048, torch.bfloat16, deep)["SWAP"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_split_product_sums_its_partials_in_a_fixed_order(tr, dtype):
    """Each column block's last program adds the partials in split order: the same bits every call
    (whichever program ends last), the counters back at zero, and the sum of the unsplit products
    over each split of K in that order."""
    g = gen(11)
    R, N, K = 16, 48, 128
    x, w, b = randn(R, K, g=g, dtype=dtype), randn(N, K, g=g, dtype=dtype), randn(N, g=g, dtype=dtype)
    cfg = CONFIGS["split"]
    assert tr.tile(N, K, dtype, cfg)["SPLIT"] == 2
    y = tr.tile_linear(x, w, b, config=cfg)
    assert not tr._counters(x.device).any()
    assert torch.equal(tr.tile_linear(x, w, b, config=cfg), y)
    one = KernelConfig(rows_n=16, rows_k=16, rows_narrow_max=24)  # the same tile, no split
    halves = [tr.tile_linear(x[:, k:k + K // 2].contiguous(), w[:, k:k + K // 2].contiguous(), config=one)
              for k in (0, K // 2)]
    if dtype == torch.float32:  # float32 outputs are the partials themselves
        assert torch.equal(y, (halves[0] + halves[1]) + b)
    assert relative_error(y, F.linear(x.double(), w.double(), b.double())) < TOL[dtype]


# -- the layers with the kernel ---------------------------------------------------------------------------

def tile_linear():
    from moestream.layers.tile_products import tile_linear as linear

    interpreted_module("moestream.kernels.triton_rows")  # what tile_products calls from now on
    return linear


def attention(qk_norm, *, seed, H=64, Nq=4, Nkv=2, D=16, max_tokens=48):
    """A plain Attention layer with q/k/v in one matrix and two empty two-layer pools."""
    g = gen(seed)
    w = AttentionWeights(q=randn(Nq * D, H, g=g) / 8, k=randn(Nkv * D, H, g=g) / 8, v=randn(Nkv * D, H, g=g) / 8,
                         o=randn(H, Nq * D, g=g) / 8)
    if qk_norm == "head":
        w.q_norm, w.k_norm = 1 + randn(D, g=g) / 4, 1 + randn(D, g=g) / 4
    w.fuse_qkv()
    attn = Attention(w, Rope(D, 1e6, torch.device("cpu")), num_heads=Nq, num_kv_heads=Nkv, head_dim=D,
                     qk_norm=qk_norm, eps=EPS)
    return attn, [pool_for([LayerKV(Nkv, D)] * 2, context=max_tokens, block_size=4) for _ in range(2)]


def rows(attn, tile, pos, pool, T, **kw):
    """attn.forward over the tile's first T rows at positions pos[:T] of sequence 0 in layer 1."""
    pool.sequences[0].reserve(int(pos[0]), int(pos[T - 1]) + 1)
    pool.sync()
    return attn.forward(tile, pos[:T], torch.zeros(T, dtype=torch.long), pool.layer(1), **kw)


@pytest.mark.parametrize("qk_norm", [None, "head"])
def test_attention_rows_with_the_kernel_match_cublas_products(qk_norm):
    """Attention.forward over a 16-row tile, steps of 1, 4 and 6 rows: the kernel's q/k/v and o products
    give F.linear's outputs and K/V cache rows (float32); a row's output bits are the same whatever
    the padding rows of the tile hold."""
    interpreted_module("moestream.kernels.triton_decode")
    linear = tile_linear()
    H, R = 64, 16
    attn, (ref_cache, cache) = attention(qk_norm, seed=21)
    x = randn(11, H, g=gen(22))
    start = 0
    for T in (1, 4, 6):
        tile = randn(R, H, g=gen(T))  # stale rows past T, as the decoder's tile holds
        tile[:T] = x[start:start + T]
        pos = torch.zeros(R, dtype=torch.long)
        pos[:T] = torch.arange(start, start + T)
        ref = rows(attn, tile, pos, ref_cache, T)
        got = rows(attn, tile, pos, cache, T, linear=linear)
        assert got.shape == (R, H)
        assert relative_error(got[:T], ref[:T]) < TOL[torch.float32]
        other = tile.clone()
        other[T:] = randn(R - T, H, g=gen(100 + T)) * 10
        again = rows(attn, other, pos, cache, T, linear=linear)  # rewrites the same K/V rows
        assert torch.equal(again[:T], got[:T])
        start += T
    for got_kv, ref_kv in zip(cache.layer(1).gather(0, 0, 11), ref_cache.layer(1).gather(0, 0, 11)):
        assert relative_error(got_kv, ref_kv) < TOL[torch.float32]


def test_a_decoder_layer_router_and_shared_expert_with_the_kernel():
    """DecoderLayer.attention_rows, then MoEBlock.route and shared_out on the tile (what the decoder's
    rows-at-once step runs per MoE layer) with the kernel: F.linear's results and expert choice."""
    from types import SimpleNamespace

    from moestream.layers.moe import MoEBlock, SharedExpert
    from moestream.layers.routers import softmax_topk
    from moestream.layers.transformer import DecoderLayer

    interpreted_module("moestream.kernels.triton_decode")
    linear = tile_linear()
    H, E, I, R, T = 64, 40, 48, 16, 5
    g = gen(31)
    attn, (ref_cache, cache) = attention("head", seed=32, H=H)
    shared = SharedExpert(randn(I, H, g=g) / 8, randn(I, H, g=g) / 8, randn(H, I, g=g) / 8, gate_weight=randn(1, H, g=g))
    block = MoEBlock(0, randn(E, H, g=g), lambda logits: softmax_topk(logits, 4, normalize=True,
                                                                      out_dtype=torch.float32),
                     experts=SimpleNamespace(reroute=None), top_k=4, shared=shared)
    layer = DecoderLayer(attn, block, 1 + randn(H, g=g) / 4, 1 + randn(H, g=g) / 4, EPS)
    x = randn(R, H, g=g)
    pos = torch.zeros(R, dtype=torch.long)
    pos[:T] = torch.arange(T)
    seqs = torch.zeros(T, dtype=torch.long)
    for pool in (ref_cache, cache):
        pool.sequences[0].reserve(0, T)
    h_ref, hn_ref = layer.attention_rows(x, pos[:T], seqs, ref_cache.layer(1))
    h, hn = layer.attention_rows(x, pos[:T], seqs, cache.layer(1), linear=linear)
    assert relative_error(h[:T], h_ref[:T]) < TOL[torch.float32]
    assert relative_error(hn[:T], hn_ref[:T]) < TOL[torch.float32]
    logits_ref, logits = block.router_logits(hn_ref), block.router_logits(hn_ref, linear=linear)
    assert relative_error(logits, logits_ref) < TOL[torch.float32]
    (w_ref, ids_ref), (w, ids) = block.route(hn_ref), block.route(hn_ref, linear=linear)
    assert torch.equal(ids, ids_ref) and relative_error(w, w_ref) < TOL[torch.float32]
    assert relative_error(block.shared_out(hn_ref, linear=linear), block.shared_out(hn_ref)) < TOL[torch.float32]


def test_the_head_over_the_tile_with_the_kernel():
    from moestream.layers.transformer import MoETransformer

    linear = tile_linear()
    g = gen(41)
    H, V = 64, 300
    model = MoETransformer(embed=randn(V, H, g=g), layers=[], final_norm=1 + randn(H, g=g) / 4,
                           lm_head=randn(V, H, g=g) / 8, rope=None, eps=EPS)
    x = randn(16, H, g=g)
    ref = model.head(x)
    assert torch.equal(model.tile_head(x), ref)  # F.linear: the head itself
    got = model.tile_head(x, linear)
    assert got.dtype == torch.float32 and relative_error(got, ref) < TOL[torch.float32]
    assert torch.equal(got.argmax(dim=-1), ref.argmax(dim=-1))


# -- the decoder's rows-at-once step with the kernel --------------------------------------------------------

def decode(engine, prompt, n, linear=None):
    """Greedy tokens and logits of prefill then n one-token steps, then the logits of the first four
    of those tokens as one step after the same prefill. linear: the decoder's products over the
    step's rows (on CUDA the decoder chooses the kernel; here the CPU is made to run it)."""
    if linear is not None:
        engine.decoder.tile_linear = linear
    logits = engine.prefill(prompt)[0][-1]
    tokens, rows = [int(logits.argmax())], []
    for _ in range(n):
        rows.append(engine.step([tokens[-1]])[-1].clone())
        tokens.append(int(rows[-1].argmax()))
    engine.reset()
    engine.prefill(prompt)
    return tokens, rows, engine.step(tokens[:4]).clone()


def test_the_decoders_rows_at_once_step_with_the_kernel(tiny_packed_model, monkeypatch):
    """A tiny qwen2_moe (a gated shared expert on every layer), float32: the decoder's step
    (Decoder._attention_rows: q/k/v, o, router and shared expert over the step's rows) with the
    kernel gives the logits of the CPU's own decoding, and a step of four tokens gives each the bits
    of its one-token step. The matrices dequantized at load, as CUDA holds them (the CPU keeps them
    packed for its native products where they are built)."""
    from moestream.cpu_share import kernels as native
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    monkeypatch.setattr(native, "_state", {"reason": "matrices as CUDA holds them"})

    interpreted_module("moestream.kernels.triton_decode")
    kernel, calls = tile_linear(), []

    def counted(x, weight, bias=None):
        calls.append(x.shape[0])
        return kernel(x, weight, bias)

    packed = tiny_packed_model("qwen2_moe", "q4", dtype="float32")
    runs = {}
    for name, linear in (("cpu", None), ("kernel", counted)):
        engine = Engine.load(packed, options=EngineOptions(device="cpu", dtype="float32", max_context=96,
                                                           cache_size="all"))
        try:
            runs[name] = decode(engine, [t % engine.args.vocab_size for t in range(5, 40)], 6, linear)
        finally:
            engine.close()
    # 7 steps x (3 layers' q/k/v and o + the one MoE layer's router and 4 shared-expert products)
    assert set(calls) == {1, 4} and len(calls) == 7 * (3 * 2 + 5)
    ref_tokens, ref_rows, ref_many = runs["cpu"]
    for name in ("kernel",):
        tokens, rows, many = runs[name]
        assert tokens == ref_tokens
        assert max(relative_error(a, b) for a, b in zip(rows, ref_rows)) < TOL[torch.float32]
        assert relative_error(many, ref_many) < TOL[torch.float32]
        assert all(torch.equal(many[t], rows[t]) for t in range(4)), name
