"""--rows-products triton on CUDA: the row tile's product kernel (moestream.kernels.triton_rows) at the
Qwen3-30B-A3B shapes is as close to a float64 product as cuBLAS, a row's bits never depend on the
rows beside it (eagerly or replayed in a CUDA graph), and a tiny model decodes with it: cuBLAS's
greedy tokens, a step of several tokens giving the bits of one-token steps, the same bits for every
cache size, and sequences decoded together getting the bits each gets alone."""
import pytest
import torch
import torch.nn.functional as F

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.kernels.expert_layout import KernelConfig

from batching_helpers import PROMPTS, SCHEDULE, alone, assert_same_bits, greedy_rows, together

pytestmark = pytest.mark.gpu
# (N, K): the fused q/k/v, o and router products of Qwen3-30B-A3B, and an odd shape
SHAPES = {"qkv": (5120, 2048), "o": (2048, 4096), "router": (128, 2048), "odd": (333, 1000)}
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
# the defaults, and K split (partials added in a fixed order by each column block's last program)
CONFIGS = {"default": KernelConfig(), "split": KernelConfig(rows_split=4, rows_narrow_split=8, rows_narrow_k=128)}


def relative_error(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def operands(N, K, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(16, K, device="cuda", generator=g).to(dtype)
    w = (torch.randn(N, K, device="cuda", generator=g) / K ** 0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    return x, w, b


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_the_kernel_is_as_close_to_float64_as_cublas(name, dtype, config):
    from functools import partial

    from moestream.kernels.triton_rows import tile_linear as kernel

    tile_linear = partial(kernel, config=CONFIGS[config])

    x, w, b = operands(*SHAPES[name], dtype)
    for bias in (None, b):
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        err, cublas = relative_error(tile_linear(x, w, bias), ref), relative_error(F.linear(x, w, bias), ref)
        # float32: one product accumulated along K in order (no split) may lose more than cuBLAS's
        # blocked sums, up to the sequential bound ~sqrt(K) * 2^-24 per output
        bound = 2 * cublas + 1e-6 if dtype != torch.float32 else max(2 * cublas, 4 * x.shape[1] ** 0.5 * 2 ** -24)
        assert err < TOL[dtype] and err <= bound, (err, cublas)


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("name", list(SHAPES))
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it(name, config):
    from functools import partial

    from moestream.kernels.triton_rows import _counters, tile_linear as kernel

    tile_linear = partial(kernel, config=CONFIGS[config])

    x, w, b = operands(*SHAPES[name], torch.bfloat16, seed=1)
    y = tile_linear(x, w, b)
    other = operands(*SHAPES[name], torch.bfloat16, seed=2)[0] * 50
    for r in (0, 7, 15):
        mixed = other.clone()
        mixed[(r + 5) % 16] = x[r]
        assert torch.equal(tile_linear(mixed, w, b)[(r + 5) % 16], y[r]), r
    for rows in (1, 5):
        assert torch.equal(tile_linear(x[:rows], w, b), y[:rows])
    out = torch.empty_like(y)  # replayed in a CUDA graph: the same bits
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tile_linear(x, w, b, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        tile_linear(x, w, b, out=out)
    for _ in range(20):  # a split's counters are back at zero after every replay
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)
    assert not _counters(x.device).any()


def load(packed, **options):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "max_context": 256, **options}))


def greedy(engine, prompt, n=20):
    return greedy_rows(engine, prompt, n)


def test_greedy_decode_with_the_kernel_gives_cublas_tokens(tiny_packed_model):
    """float32, every expert resident: the same greedy tokens as cuBLAS products, logits within
    float32's rounding; and a step of several tokens gives each token the bits of one-token steps."""
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="float32")
    runs = {}
    for products in ("cublas", "triton"):
        engine = load(packed, dtype="float32", cache_size="all")
        try:
            assert engine.decoder.rows_at_once and engine.decoder.tile_linear is not F.linear
            if products == "cublas":  # the reference: the same step on cuBLAS products
                engine.decoder.tile_linear = F.linear
                engine.decoder._boundaries(True)
            prompt = [t % engine.args.vocab_size for t in range(5, 60)]
            runs[products] = greedy(engine, prompt)
            if products == "triton":
                engine.reset()
                engine.prefill(prompt)
                many = engine.step(runs[products][0][:4])  # four rows at once
                assert all(torch.equal(many[t], runs[products][1][t]) for t in range(4))
        finally:
            engine.close()
    (ref_tokens, ref_rows), (tokens, rows) = runs["cublas"], runs["triton"]
    assert tokens == ref_tokens
    assert max(relative_error(a, b) for a, b in zip(rows, ref_rows)) < 1e-4


def test_the_kernel_gives_the_same_bits_for_every_cache_size(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    runs = []
    for size in ("all", "50%"):
        engine = load(packed, dtype="bfloat16", cache_size=size)
        try:
            runs.append(greedy(engine, [t % engine.args.vocab_size for t in range(7, 90)], n=12))
        finally:
            engine.close()
    assert runs[0][0] == runs[1][0]
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))


def test_sequences_together_get_the_bits_each_gets_alone(tiny_packed_model):
    """qwen2_moe (a shared expert with its gate, on the kernel too), several sequences' rows in one step."""
    packed = tiny_packed_model("qwen2_moe", "q4", dtype="bfloat16")
    single = load(packed, dtype="bfloat16", cache_size="all")
    prompts = [single.tokenizer.encode(p) for p in PROMPTS]
    expected = [alone(single, p, end - begin) for p, (begin, end) in zip(prompts, SCHEDULE)]
    single.close()
    engine = load(packed, dtype="bfloat16", cache_size="all", max_sequences=3)
    engine.close_sequence(0)
    assert_same_bits(together(engine, prompts, SCHEDULE), expected)
    engine.close()
