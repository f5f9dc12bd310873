"""The paged attention kernels (moestream.kernels.triton_paged_attention) on CUDA at the attention
shapes of Gemma-4-26B-A4B (sliding and full layers), gpt-oss-20b, Qwen3-30B-A3B and a latent (MLA)
layer: decode and prefill agree with the float32 torch reference (tests/paged_attention_reference.py)
within the dtype's tolerance up to 32k positions; a decode row's bits never depend on the other rows
of the call, nor a prefill row's on the other rows of its tile; store_kv writes the reference's
bits; store_kv + paged_attention (and paged_prefill) replay from one CUDA graph at changing positions
with the bits of eager calls."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from paged_attention_reference import paged_cache, reference_paged_attention, reference_store_kv  # noqa: E402

from moestream.kernels import triton_paged_attention as pa  # noqa: E402

DEV = "cuda"
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2, torch.float32: 2e-5}  # max |y - ref| / max |ref|

# name: (Nq, Nkv, D, Dv, window, sinks, softcap)
SHAPES = {
    "gemma4-sliding": (16, 8, 256, 256, 1024, False, None),
    "gemma4-full": (16, 2, 512, 512, None, False, None),
    "gpt-oss-sliding": (64, 8, 64, 64, 128, True, None),
    "gpt-oss-full": (64, 8, 64, 64, None, True, None),
    "qwen3": (32, 4, 128, 128, None, False, None),
    "softcap-odd-head": (8, 2, 80, 80, 300, False, 50.0),
    "latent": (16, 1, 576, 512, None, False, None),  # v a view of the key cache's first 512 features
}


def relative_error(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def build(name, dtype, seqs, *, seed, BS=16, T=None):
    """The shape's cache holding `seqs` (lengths) and rows: every sequence's last position, then
    positions spread over the sequences. -> (q, k_cache, v_cache, table, pos, seq, options)."""
    Nq, Nkv, D, Dv, window, sinks, softcap = SHAPES[name]
    g = torch.Generator().manual_seed(seed)
    k_cache, v_cache, table = paged_cache(g, seqs=list(seqs), BS=BS, Nkv=Nkv, D=D, Dv=D if name == "latent" else Dv,
                                          dtype=dtype)
    k_cache, v_cache, table = k_cache.to(DEV), v_cache.to(DEV), table.to(DEV)
    if name == "latent":
        v_cache = k_cache[..., :Dv]
    rows = [(s, n - 1) for s, n in enumerate(seqs)]
    T = len(rows) if T is None else T
    while len(rows) < T:
        s = int(torch.randint(len(seqs), (1,), generator=g))
        rows.append((s, int(torch.randint(seqs[s], (1,), generator=g))))
    seq = torch.tensor([s for s, _ in rows[:T]], device=DEV)
    pos = torch.tensor([p for _, p in rows[:T]], device=DEV)
    q = torch.randn(T, Nq, D, generator=g).to(dtype).to(DEV)
    opts = {"scale": D ** -0.5, "window": window, "softcap": softcap,
            "sinks": torch.randn(Nq, generator=g).to(DEV) if sinks else None}
    return q, k_cache, v_cache, table, pos, seq, opts


# -- against the reference ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_decode_matches_the_reference(name, dtype):
    dtype = DTYPES[dtype]
    q, k_cache, v_cache, table, pos, seq, opts = build(name, dtype, [1, 130, 2049, 5000], seed=1, T=16)
    out = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, out_rows=20, **opts)
    ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, out_rows=20, **opts)
    assert out.shape == ref.shape and out.dtype == dtype
    assert relative_error(out, ref) < TOL[dtype]
    assert not out[16:].any()


@pytest.mark.parametrize("name", ["gemma4-sliding", "gemma4-full", "gpt-oss-full", "qwen3", "latent"])
def test_decode_at_32k_positions(name):
    q, k_cache, v_cache, table, pos, seq, opts = build(name, torch.bfloat16, [32768, 20000], seed=2, T=4)
    out = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, **opts)
    ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, **opts)
    assert relative_error(out, ref) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_prefill_matches_the_reference(name, dtype):
    """A chunk of 300 consecutive positions of one sequence with rows of two others among it."""
    dtype = DTYPES[dtype]
    q, k_cache, v_cache, table, _, _, opts = build(name, dtype, [2000, 50, 1500], seed=3)
    seq = torch.tensor([2] * 150 + [1, 0] + [2] * 150, device=DEV)
    pos = torch.cat([torch.arange(1100, 1250), torch.tensor([49, 1999]), torch.arange(1250, 1400)]).to(DEV)
    q = torch.randn(seq.numel(), q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(4)).to(dtype).to(DEV)
    out = pa.paged_prefill(q, k_cache, v_cache, table, pos, seq, out_rows=310, **opts)
    ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, out_rows=310, **opts)
    assert relative_error(out, ref) < TOL[dtype]
    assert not out[seq.numel():].any()


@pytest.mark.parametrize("name", ["gemma4-sliding", "qwen3"])
def test_prefill_of_a_long_prompt(name):
    """2,048 positions from the start (causal, and the window masking most keys of late rows)."""
    q, k_cache, v_cache, table, _, _, opts = build(name, torch.bfloat16, [2048], seed=5)
    pos = torch.arange(2048, device=DEV)
    seq = torch.zeros(2048, dtype=torch.long, device=DEV)
    q = torch.randn(2048, q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(6)).to(q.dtype).to(DEV)
    out = pa.paged_prefill(q, k_cache, v_cache, table, pos, seq, **opts)
    rows = torch.tensor([0, 1, 700, 1023, 1024, 1500, 2047], device=DEV)
    ref = reference_paged_attention(q[rows], k_cache, v_cache, table, pos[rows], seq[rows], **opts)
    assert relative_error(out[rows], ref) < TOL[torch.bfloat16]


def test_store_kv_writes_the_reference_bits():
    g = torch.Generator().manual_seed(7)
    k_cache, v_cache, table = (t.to(DEV) for t in paged_cache(g, seqs=[40, 300], BS=16, Nkv=8, D=256, Dv=256,
                                                               dtype=torch.bfloat16))
    kv = torch.randn(6, 8, 512, generator=g).to(torch.bfloat16).to(DEV)
    k, v = kv[..., :256], kv[..., 256:]
    pos = torch.tensor([39, 0, 15, 16, 299, 17], device=DEV, dtype=torch.int32)
    seq = torch.tensor([0, 1, 1, 1, 1, 0], device=DEV)
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference_store_kv(k, v, pos, seq, table, ref_k, ref_v)
    pa.store_kv(k, v, pos, seq, table, k_cache, v_cache)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_slots_no_row_sees_are_never_used(kernel):
    """Rows of one sequence whose windows do not meet share a program; every slot of the pool that no
    row may see is NaN: the same bits."""
    q, k_cache, v_cache, table, _, _, opts = build("gpt-oss-sliding", torch.bfloat16, [3000, 500], seed=15)
    pos = torch.tensor([100, 1000, 2999, 499, 1500], device=DEV)
    seq = torch.tensor([0, 0, 0, 1, 0], device=DEV)
    q = torch.randn(5, q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(16)).to(q.dtype).to(DEV)
    fn = pa.paged_attention if kernel == "decode" else pa.paged_prefill
    clean = fn(q, k_cache, v_cache, table, pos, seq, **opts)
    BS, window = k_cache.shape[1], opts["window"]
    visible = torch.zeros(k_cache.shape[:2], dtype=torch.bool, device=DEV)
    for s, p in zip(seq.tolist(), pos.tolist()):
        n = torch.arange(p - window + 1, p + 1, device=DEV)
        visible[table[s].long()[n // BS], n % BS] = True
    k_nan, v_nan = k_cache.clone(), v_cache.clone()
    k_nan[~visible] = float("nan")
    v_nan[~visible] = float("nan")
    assert torch.equal(fn(q, k_nan, v_nan, table, pos, seq, **opts), clean)
    assert clean.isfinite().all()


# -- row independence -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["gemma4-sliding", "gemma4-full", "gpt-oss-sliding", "qwen3"])
def test_a_decode_rows_bits_do_not_depend_on_the_other_rows(name, dtype):
    """16 rows (several sequences, short and long contexts; a program takes several rows and reads
    their sequence's K/V once): each row alone, among all, reversed and shuffled with repeats gives
    the same bits."""
    q, k_cache, v_cache, table, pos, seq, opts = build(name, DTYPES[dtype], [3, 700, 9000, 33], seed=8, T=16)
    every = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, **opts)
    for t in range(16):
        alone = pa.paged_attention(q[t:t + 1], k_cache, v_cache, table, pos[t:t + 1], seq[t:t + 1], **opts)
        assert torch.equal(alone[0], every[t]), t
    g = torch.Generator().manual_seed(9)
    for order in (torch.arange(15, -1, -1), torch.randint(16, (11,), generator=g)):
        order = order.to(DEV)
        got = pa.paged_attention(q[order], k_cache, v_cache, table, pos[order], seq[order], out_rows=16, **opts)
        assert torch.equal(got[:order.numel()], every[order])


@pytest.mark.parametrize("name", list(SHAPES))
def test_drafted_rows_at_32k_get_the_bits_of_single_steps(name):
    """16 consecutive positions near the end of a 32k sequence in one call (a step verifying drafted
    tokens): the reference within tolerance, and each row the bits of its own single-row call."""
    q, k_cache, v_cache, table, _, _, opts = build(name, torch.bfloat16, [32768], seed=13)
    pos = torch.arange(32752, 32768, device=DEV)
    seq = torch.zeros(16, dtype=torch.long, device=DEV)
    q = torch.randn(16, q.shape[1], q.shape[2], generator=torch.Generator().manual_seed(14)).to(q.dtype).to(DEV)
    every = pa.paged_attention(q, k_cache, v_cache, table, pos, seq, **opts)
    ref = reference_paged_attention(q, k_cache, v_cache, table, pos, seq, **opts)
    assert relative_error(every, ref) < TOL[torch.bfloat16]
    for t in range(16):
        alone = pa.paged_attention(q[t:t + 1], k_cache, v_cache, table, pos[t:t + 1], seq[t:t + 1], **opts)
        assert torch.equal(alone[0], every[t]), t


@pytest.mark.parametrize("name", ["gemma4-sliding", "gpt-oss-sliding", "qwen3"])
def test_a_prefill_rows_bits_do_not_depend_on_the_other_rows_of_its_tile(name):
    """A prefill row gets the same bits alone and among other rows (other sequences, positions,
    queries), at any place in its tile."""
    q, k_cache, v_cache, table, _, _, opts = build(name, torch.bfloat16, [600, 200], seed=10)
    T = 96
    g = torch.Generator().manual_seed(11)
    seq = torch.zeros(T, dtype=torch.long)
    pos = torch.arange(500, 500 + T)
    q = torch.randn(T, q.shape[1], q.shape[2], generator=g).to(q.dtype).to(DEV)
    every = pa.paged_prefill(q, k_cache, v_cache, table, pos.to(DEV), seq.to(DEV), **opts)
    for t in (0, 1, 37, 95):
        seq2 = torch.randint(2, (T,), generator=g)
        pos2 = torch.randint(200, (T,), generator=g)
        seq2[t], pos2[t] = seq[t], pos[t]
        q2 = torch.randn(q.shape, generator=g).to(q.dtype).to(DEV)
        q2[t] = q[t]
        got = pa.paged_prefill(q2, k_cache, v_cache, table, pos2.to(DEV), seq2.to(DEV), **opts)
        assert torch.equal(got[t], every[t]), t
        alone = pa.paged_prefill(q[t:t + 1], k_cache, v_cache, table, pos[t:t + 1].to(DEV),
                                 seq[t:t + 1].to(DEV), **opts)
        assert torch.equal(alone[0], every[t]), t
    shuffled = torch.randperm(T, generator=g).to(DEV)
    got = pa.paged_prefill(q[shuffled], k_cache, v_cache, table, pos.to(DEV)[shuffled], seq.to(DEV)[shuffled], **opts)
    assert torch.equal(got, every[shuffled])


# -- CUDA graphs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
@pytest.mark.parametrize("name", ["gemma4-sliding", "gpt-oss-sliding", "qwen3"])
@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_one_cuda_graph_serves_every_position(name, dtype, kernel):
    """store_kv then attention captured once (static q/k/v, positions, sequences, table); replayed at
    other positions and sequences it gives the bits of eager calls on the same cache, and the reference."""
    dtype = DTYPES[dtype]
    q, k_cache, v_cache, table, pos, seq, opts = build(name, dtype, [4000, 1500], seed=12, T=4)
    Nkv, D, Dv = k_cache.shape[2], k_cache.shape[3], v_cache.shape[3]
    k = torch.randn(4, Nkv, D, device=DEV).to(dtype)
    v = torch.randn(4, Nkv, Dv, device=DEV).to(dtype)
    attend = pa.paged_attention if kernel == "decode" else pa.paged_prefill

    def step(kc, vc):
        pa.store_kv(k, v, pos, seq, table, kc, vc)
        return attend(q, kc, vc, table, pos, seq, out_rows=8, **opts)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load the kernels outside the capture
        step(k_cache.clone(), v_cache.clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(k_cache, v_cache)
    for rows in ([(0, 3999), (1, 0), (0, 2), (1, 1499)], [(1, 700), (1, 701), (1, 702), (0, 1023)]):
        pos.copy_(torch.tensor([p for _, p in rows]))
        seq.copy_(torch.tensor([s for s, _ in rows]))
        q.copy_(torch.randn(q.shape, device=DEV).to(dtype))
        k.copy_(torch.randn(k.shape, device=DEV).to(dtype))
        v.copy_(torch.randn(v.shape, device=DEV).to(dtype))
        kc, vc = k_cache.clone(), v_cache.clone()
        expect = step(kc, vc)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect), rows
        assert torch.equal(k_cache, kc) and torch.equal(v_cache, vc)
        ref = reference_paged_attention(q, kc, vc, table, pos, seq, out_rows=8, **opts)
        assert relative_error(out, ref) < TOL[dtype], rows
