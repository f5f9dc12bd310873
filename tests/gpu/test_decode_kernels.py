"""The fused decode kernels (moestream.kernels.triton_decode) on CUDA at Qwen3-30B-A3B sizes: the
norms and rotary give torch's bits (up to the float32 summation order of a norm), attention agrees
with SDPA within the dtype's tolerance, everything is deterministic, and rope_qk_store +
decode_attention replay from one CUDA graph at any position."""
import math

import pytest
import torch
import torch.nn.functional as F


class KVCache:
    """The contiguous per-sequence cache these kernels read: keys/values [layers, Nkv, tokens, D]."""

    def __init__(self, layers, heads, D, tokens, *, dtype, device):
        self.keys = torch.zeros((layers, heads, tokens, D), dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)


pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from moestream.kernels import triton_decode as td  # noqa: E402
from moestream.layers.norm import rms_norm as torch_rms_norm  # noqa: E402
from moestream.layers.rope import Rope, apply_rope  # noqa: E402

DEV = "cuda"
H, NQ, NKV, D, MAX_TOKENS = 2048, 32, 4, 128, 4096
POSITIONS = [0, 1, 777, 4095]
EPS, THETA = 1e-6, 1e6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ATTN_TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}  # max |y - ref| / max |ref|


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def relative_error(y, ref):
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()


def ulps(a, b):
    """|a - b| in units in the last place of the dtype, elementwise (int64)."""
    bits, mag = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                 torch.float32: (torch.int32, 0x7FFFFFFF)}[a.dtype]

    def ordered(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & mag), i & mag)

    return (ordered(a) - ordered(b)).abs()


def assert_torch_bits_up_to_sum_order(y, ref):
    # A different float32 sum can move rstd by an ulp or two; that rarely changes a rounded x*rstd
    # (by one ulp), and the weight multiply can spread that to two.
    d = ulps(y, ref)
    assert d.max() <= (8 if y.dtype == torch.float32 else 2), d.max()
    if y.dtype != torch.float32:
        assert (d == 0).float().mean() >= 0.999


# -- norms ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("T", [1, 7, 32])
def test_rms_norm_and_add_rms_norm(T, dtype):
    dtype = DTYPES[dtype]
    g = gen(T)
    x, y = randn(T, H, g=g, dtype=dtype), randn(T, H, g=g, dtype=dtype)
    w = (1 + randn(H, g=g) / 4).to(dtype)
    assert_torch_bits_up_to_sum_order(td.rms_norm(x, w, EPS), torch_rms_norm(x, w, EPS))
    h, hn = td.add_rms_norm(x, y, w, EPS)
    assert torch.equal(h, x + y)
    assert_torch_bits_up_to_sum_order(hn, torch_rms_norm(x + y, w, EPS))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_rms_norm_is_torch_bits_when_the_sum_is_exact(dtype):
    """Inputs k/8 with small k: every partial sum of squares is exact in float32, so the summation
    order cannot matter and the kernels must give torch's bits exactly (rsqrt included)."""
    dtype = DTYPES[dtype]
    g = gen(1)
    x = (torch.randint(-24, 25, (5, H), generator=g, device=DEV) / 8).to(dtype)
    y = (torch.randint(-24, 25, (5, H), generator=g, device=DEV) / 8).to(dtype)
    w = (1 + randn(H, g=g) / 4).to(dtype)
    assert torch.equal(td.rms_norm(x, w, EPS), torch_rms_norm(x, w, EPS))
    h, hn = td.add_rms_norm(x, y, w, EPS)
    assert torch.equal(h, x + y) and torch.equal(hn, torch_rms_norm(x + y, w, EPS))


# -- rotary + cache write ----------------------------------------------------------------------------

def qkv_views(g, dtype):
    """q, k, v as views into one fused projection row, as a fused qkv linear would give them."""
    qkv = randn(1, (NQ + 2 * NKV) * D, g=g, dtype=dtype)
    return qkv.split([NQ * D, NKV * D, NKV * D], dim=-1)


def reference_qk(q, k, pos, rope, q_norm, k_norm):
    cos, sin = rope.cos_sin(pos, q.dtype)
    q, k = q.view(1, NQ, D), k.view(1, NKV, D)
    if q_norm is not None:
        q, k = torch_rms_norm(q, q_norm, EPS), torch_rms_norm(k, k_norm, EPS)
    return apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin)


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rotary_angles_are_torch_bits(dtype):
    """q = (1, .., 1, 0, .., 0) per head comes out as (cos, sin): the kernel's cos/sin (libdevice)
    must be torch's, rounded to the dtype, including at large angles."""
    dtype = DTYPES[dtype]
    rope = Rope(D, THETA, torch.device(DEV))
    q = torch.cat([torch.ones(NQ, D // 2), torch.zeros(NQ, D // 2)], dim=1).reshape(1, NQ * D).to(DEV, dtype)
    kv = torch.zeros(1, NKV * D, dtype=dtype, device=DEV)
    cache = torch.zeros(NKV, 40000, D, dtype=dtype, device=DEV)
    for p in POSITIONS + [32767, 39999]:
        pos = torch.tensor([p], device=DEV)
        q_out = td.rope_qk_store(q, kv, kv, pos, rope.inv_freq, cache, cache.clone())
        cos, sin = rope.cos_sin(pos, dtype)
        assert torch.equal(q_out[:, 0, :D // 2], cos[:, :D // 2].expand(NQ, -1)), p
        assert torch.equal(q_out[:, 0, D // 2:], sin[:, D // 2:].expand(NQ, -1)), p


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rope_qk_store(dtype, norm):
    dtype = DTYPES[dtype]
    g = gen(2 + norm)
    rope = Rope(D, THETA, torch.device(DEV))
    q_norm, k_norm = ((1 + randn(D, g=g) / 4).to(dtype), (1 + randn(D, g=g) / 4).to(dtype)) if norm else (None, None)
    cache = KVCache(3, NKV, D, MAX_TOKENS, dtype=dtype, device=torch.device(DEV))
    cache.keys.normal_(generator=g)
    cache.values.normal_(generator=g)
    for p in POSITIONS:
        q, k, v = qkv_views(g, dtype)
        pos = torch.tensor([p], device=DEV)
        before_k, before_v = cache.keys.clone(), cache.values.clone()
        q_out = td.rope_qk_store(q, k, v, pos, rope.inv_freq, cache.keys[1], cache.values[1], q_norm=q_norm,
                                 k_norm=k_norm, eps=EPS)
        ref_q, ref_k = reference_qk(q, k, pos, rope, q_norm, k_norm)
        assert q_out.shape == (NQ, 1, D) and q_out.dtype == dtype and q_out.is_contiguous()
        if norm:  # only the head norm's float32 sum order may differ from torch
            for y, ref in ((q_out, ref_q), (cache.keys[1, :, p], ref_k[:, 0])):
                assert relative_error(y, ref) < (2e-2 if dtype == torch.bfloat16 else 1e-5)
                if dtype != torch.float32:
                    assert (y == ref).float().mean() >= 0.99
        else:
            assert torch.equal(q_out, ref_q)
            assert torch.equal(cache.keys[1, :, p], ref_k[:, 0])
        assert torch.equal(cache.values[1, :, p], v.view(NKV, D))
        untouched = torch.ones(3, NKV, MAX_TOKENS, dtype=torch.bool, device=DEV)
        untouched[1, :, p] = False
        assert torch.equal(cache.keys[untouched], before_k[untouched])
        assert torch.equal(cache.values[untouched], before_v[untouched])
        again = cache.keys.clone()
        assert torch.equal(td.rope_qk_store(q, k, v, pos, rope.inv_freq, cache.keys[1], cache.values[1],
                                            q_norm=q_norm, k_norm=k_norm, eps=EPS), q_out)
        assert torch.equal(cache.keys, again)


# -- attention ---------------------------------------------------------------------------------------

def reference_attention(q, keys, values, p):
    """SDPA over positions 0..p, kv heads repeated per group, in float64 -> [1, Nq*D]."""
    groups = q.shape[0] // keys.shape[0]
    K = keys[:, :p + 1].double().repeat_interleave(groups, dim=0)
    V = values[:, :p + 1].double().repeat_interleave(groups, dim=0)
    out = F.scaled_dot_product_attention(q.double()[None], K[None], V[None])
    return out[0].transpose(0, 1).reshape(1, q.shape[0] * q.shape[-1])


def attention_inputs(dtype, max_tokens, seed):
    g = gen(seed)
    cache = randn(2, 2, NKV, max_tokens, D, g=g, dtype=dtype)  # [k/v, layer, ...]; layer 1 is a view
    return (2 * randn(NQ, 1, D, g=g)).to(dtype), cache[0, 1], cache[1, 1]


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_decode_attention(dtype):
    dtype = DTYPES[dtype]
    q, keys, values = attention_inputs(dtype, MAX_TOKENS, seed=3)
    for p in POSITIONS:
        pos = torch.tensor([p], device=DEV)
        out = td.decode_attention(q, keys, values, pos)
        assert out.shape == (1, NQ * D) and out.dtype == dtype
        assert relative_error(out, reference_attention(q, keys, values, p)) < ATTN_TOL[dtype], p
        assert torch.equal(out, td.decode_attention(q, keys, values, pos))  # same bits every run


def test_decode_attention_long_context():
    """32k keys: 256 splits of 128, several combine steps."""
    q, keys, values = attention_inputs(torch.bfloat16, 32768, seed=4)
    for p in (5000, 32767):
        out = td.decode_attention(q, keys, values, torch.tensor([p], device=DEV))
        assert relative_error(out, reference_attention(q, keys, values, p)) < ATTN_TOL[torch.bfloat16], p


def test_decode_attention_bits_do_not_depend_on_the_cache_length():
    q, keys, values = attention_inputs(torch.bfloat16, MAX_TOKENS, seed=5)
    pos = torch.tensor([777], device=DEV)
    out = td.decode_attention(q, keys, values, pos)
    assert torch.equal(out, td.decode_attention(q, keys[:, :1000], values[:, :1000], pos))
    assert td.num_splits(MAX_TOKENS) == MAX_TOKENS // td.DEFAULT_SPLIT


# -- CUDA graphs --------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_one_cuda_graph_serves_every_position(dtype):
    dtype = DTYPES[dtype]
    g = gen(7)
    rope = Rope(D, THETA, torch.device(DEV))
    q_norm, k_norm = (1 + randn(D, g=g) / 4).to(dtype), (1 + randn(D, g=g) / 4).to(dtype)
    cache = KVCache(2, NKV, D, MAX_TOKENS, dtype=dtype, device=torch.device(DEV))
    cache.keys.normal_(generator=g)
    cache.values.normal_(generator=g)
    qkv = randn(1, (NQ + 2 * NKV) * D, g=g, dtype=dtype)  # the graph's static input row
    pos = torch.zeros(1, dtype=torch.long, device=DEV)

    def step(keys, values):
        q, k, v = qkv.split([NQ * D, NKV * D, NKV * D], dim=-1)
        q = td.rope_qk_store(q, k, v, pos, rope.inv_freq, keys, values, q_norm=q_norm, k_norm=k_norm, eps=EPS)
        return td.decode_attention(q, keys, values, pos)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and load the kernels outside the capture
        step(cache.keys[1], cache.values[1])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(cache.keys[1], cache.values[1])

    for p in (777, 3000, 5):
        qkv.copy_(randn(1, qkv.shape[1], g=g, dtype=dtype))
        pos.fill_(p)
        keys, values = cache.keys[1].clone(), cache.values[1].clone()
        expect = step(keys, values)  # eager, on copies of the cache as it is before the replay
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expect), p
        assert torch.equal(cache.keys[1], keys) and torch.equal(cache.values[1], values), p
        assert relative_error(out, reference_attention(step_q(qkv, pos, rope, q_norm, k_norm), keys, values, p)) \
            < ATTN_TOL[dtype], p


def step_q(qkv, pos, rope, q_norm, k_norm):
    """The torch reference q [Nq, 1, D] of a fused qkv row."""
    q, k, _ = qkv.split([NQ * D, NKV * D, NKV * D], dim=-1)
    return reference_qk(q, k, pos, rope, q_norm, k_norm)[0]


def test_default_scale_is_one_over_sqrt_head_dim():
    q, keys, values = attention_inputs(torch.float32, 256, seed=8)
    pos = torch.tensor([200], device=DEV)
    assert torch.equal(td.decode_attention(q, keys, values, pos),
                       td.decode_attention(q, keys, values, pos, scale=1 / math.sqrt(D)))


# -- T rows at once -------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_rows_at_once_give_each_row_its_bits_alone(dtype):
    """rope_qk_store_rows + decode_attention_rows over 5 rows of 3 sequence slots (one pooled layer,
    q/k/v strided views of one fused product, later rows of a slot seeing earlier rows' K/V) equal
    the one-row kernels row after row, bit for bit; the 16-row output's padding rows are zero."""
    dtype = DTYPES[dtype]
    g = gen(21)
    S, L, layer, R = 3, 2, 1, 16
    pool_k = randn(S, L, NKV, 512, D, g=g, dtype=dtype)
    pool_v = randn(S, L, NKV, 512, D, g=g, dtype=dtype)
    slots, positions = [2, 0, 2, 1, 2], [300, 40, 301, 511, 302]
    T = len(slots)
    qkv = randn(R, (NQ + 2 * NKV) * D, g=g, dtype=dtype)
    q, k, v = qkv[:, :NQ * D], qkv[:, NQ * D:(NQ + NKV) * D], qkv[:, (NQ + NKV) * D:]
    qn, kn = (1 + randn(D, g=g) / 4).to(dtype), (1 + randn(D, g=g) / 4).to(dtype)
    inv_freq = Rope(D, THETA, torch.device(DEV)).inv_freq
    pos, slot = torch.tensor(positions, device=DEV), torch.tensor(slots, device=DEV)
    keys, values = pool_k.clone(), pool_v.clone()
    qo = td.rope_qk_store_rows(q[:T], k[:T], v[:T], pos, inv_freq, keys[:, layer], values[:, layer], q_norm=qn,
                               k_norm=kn, eps=EPS, slot=slot)
    out = td.decode_attention_rows(qo, keys[:, layer], values[:, layer], pos, out_rows=R, slot=slot)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    alone = [td.rope_qk_store(q[t:t + 1], k[t:t + 1], v[t:t + 1], pos[t:t + 1], inv_freq, ref_k[:, layer],
                              ref_v[:, layer], q_norm=qn, k_norm=kn, eps=EPS, slot=slot[t:t + 1]) for t in range(T)]
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    for t in range(T):
        assert torch.equal(qo[t], alone[t][:, 0])
        one = td.decode_attention(alone[t], ref_k[:, layer], ref_v[:, layer], pos[t:t + 1], slot=slot[t:t + 1])
        assert torch.equal(out[t:t + 1], one), t
    assert not out[T:].any()
