"""The fused decode kernels (moestream.kernels.triton_decode) under Triton's CPU interpreter
(TRITON_INTERPRET=1), at tiny sizes: they agree with moestream's own torch code (layers/norm.py,
layers/rope.py, the SDPA attention of layers/attention.py), write exactly one cache row per kv head,
and give the same attention bits run to run and for any cache length.

Runs in the interpreter's own stage (tests/interpret/interpreter.py). Skipped where Triton is not
installed. Float32 is checked tightly; bfloat16 only loosely, because the interpreter truncates
float32 -> bfloat16 where the GPU rounds to nearest (tests/gpu checks the bf16 bits)."""

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from interpreter import gen, interpreted_module, randn, relative_error  # noqa: E402

from moestream.layers.norm import rms_norm as torch_rms_norm  # noqa: E402
from moestream.layers.rope import Rope, apply_rope  # noqa: E402

EPS = 1e-6
THETA = 1e6
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # max |y - ref| / max |ref|


@pytest.fixture(scope="module")
def td():
    return interpreted_module("moestream.kernels.triton_decode")


# -- norms ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N", [(1, 64), (5, 200), (3, 256)])
def test_rms_norm(td, T, N, dtype):
    g = gen(N + T)
    big = randn(T, N + 24, g=g, dtype=dtype)
    x = big[:, 8:8 + N]  # strided rows at an offset
    w = randn(N, g=g, dtype=dtype)
    ref = torch_rms_norm(x, w, EPS)
    y = td.rms_norm(x, w, EPS)
    assert y.dtype == dtype and y.shape == (T, N)
    assert relative_error(y, ref) < TOL[dtype]
    out = torch.full((T, N), 7.0, dtype=dtype)
    assert td.rms_norm(x, w, EPS, out=out) is out and torch.equal(out, y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N", [(1, 128), (4, 96)])
def test_add_rms_norm(td, T, N, dtype):
    g = gen(N * T)
    x, y, w = randn(T, N, g=g, dtype=dtype), randn(T, N, g=g, dtype=dtype), randn(N, g=g, dtype=dtype)
    h, hn = td.add_rms_norm(x, y, w, EPS)
    if dtype == torch.float32:
        assert torch.equal(h, x + y)
    assert relative_error(h, x + y) < TOL[dtype]
    assert relative_error(hn, torch_rms_norm(x + y, w, EPS)) < TOL[dtype]


# -- rotary + cache write ----------------------------------------------------------------------------

def reference_qk(q, k, pos, D, dtype, q_norm, k_norm):
    """moestream's path: per-head rms_norm, then Rope.cos_sin + apply_rope. -> [N, 1, D] each."""
    Nq, Nkv = q.shape[-1] // D, k.shape[-1] // D
    cos, sin = Rope(D, THETA, torch.device("cpu")).cos_sin(pos, dtype)
    q, k = q.view(1, Nq, D), k.view(1, Nkv, D)
    if q_norm is not None:
        q, k = torch_rms_norm(q, q_norm, EPS), torch_rms_norm(k, k_norm, EPS)
    return apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin)


@pytest.mark.parametrize("norm", [False, True], ids=["plain", "qk_norm"])
@pytest.mark.parametrize("D,max_tokens", [(16, 40), (32, 130)])
def test_rope_qk_store(td, D, max_tokens, norm):
    Nq, Nkv, L, layer = 4, 2, 3, 1
    g = gen(D + norm)
    keys_all = randn(L, Nkv, max_tokens, D, g=g)
    values_all = randn(L, Nkv, max_tokens, D, g=g)
    inv_freq = Rope(D, THETA, torch.device("cpu")).inv_freq
    q_norm, k_norm = (randn(D, g=g), randn(D, g=g)) if norm else (None, None)
    for p in (0, 1, max_tokens // 2 + 1, max_tokens - 1):
        # q, k, v: views at offsets into one fused projection row, as the engine's qkv linear gives them
        qkv = randn(1, 3 + (Nq + 2 * Nkv) * D, g=g)[:, 3:]
        q, k, v = qkv.split([Nq * D, Nkv * D, Nkv * D], dim=-1)
        pos = torch.tensor([p])
        keys, values = keys_all.clone(), values_all.clone()
        q_out = td.rope_qk_store(q, k, v, pos, inv_freq, keys[layer], values[layer], q_norm=q_norm, k_norm=k_norm,
                                 eps=EPS)
        ref_q, ref_k = reference_qk(q, k, pos, D, torch.float32, q_norm, k_norm)
        assert q_out.shape == (Nq, 1, D) and q_out.is_contiguous()
        assert relative_error(q_out, ref_q) < TOL[torch.float32]
        assert relative_error(keys[layer, :, p], ref_k[:, 0]) < TOL[torch.float32]
        assert torch.equal(values[layer, :, p], v.view(Nkv, D))
        untouched = torch.ones(L, Nkv, max_tokens, dtype=torch.bool)
        untouched[layer, :, p] = False
        assert torch.equal(keys[untouched], keys_all[untouched])
        assert torch.equal(values[untouched], values_all[untouched])


def test_rope_qk_store_bf16(td):
    Nq, Nkv, D, max_tokens, p = 4, 2, 32, 64, 45
    g = gen(5)
    dt = torch.bfloat16
    q, k, v = randn(1, Nq * D, g=g, dtype=dt), randn(1, Nkv * D, g=g, dtype=dt), randn(1, Nkv * D, g=g, dtype=dt)
    q_norm, k_norm = randn(D, g=g, dtype=dt), randn(D, g=g, dtype=dt)
    keys, values = torch.zeros(Nkv, max_tokens, D, dtype=dt), torch.zeros(Nkv, max_tokens, D, dtype=dt)
    pos = torch.tensor([p])
    inv_freq = Rope(D, THETA, torch.device("cpu")).inv_freq
    q_out = td.rope_qk_store(q, k, v, pos, inv_freq, keys, values, q_norm=q_norm, k_norm=k_norm, eps=EPS)
    ref_q, ref_k = reference_qk(q, k, pos, D, dt, q_norm, k_norm)
    assert q_out.dtype == dt
    assert relative_error(q_out, ref_q) < TOL[dt]
    assert relative_error(keys[:, p], ref_k[:, 0]) < TOL[dt]
    assert torch.equal(values[:, p], v.view(Nkv, D))
    assert keys[:, :p].abs().sum() == 0 and keys[:, p + 1:].abs().sum() == 0


def test_a_position_past_the_cache_writes_nothing(td):
    Nq, Nkv, D, max_tokens = 2, 1, 16, 20
    keys, values = torch.zeros(Nkv, max_tokens, D), torch.zeros(Nkv, max_tokens, D)
    q, k, v = torch.ones(1, Nq * D), torch.ones(1, Nkv * D), torch.ones(1, Nkv * D)
    td.rope_qk_store(q, k, v, torch.tensor([max_tokens]), Rope(D, THETA, torch.device("cpu")).inv_freq, keys, values)
    assert keys.abs().sum() == 0 and values.abs().sum() == 0


# -- attention ---------------------------------------------------------------------------------------

def reference_attention(q, keys, values, p):
    """SDPA over cache positions 0..p with kv heads repeated per group, in float64. -> [1, Nq*D]"""
    Nq, groups = q.shape[0], q.shape[0] // keys.shape[0]
    K = keys[:, :p + 1].double().repeat_interleave(groups, dim=0)
    V = values[:, :p + 1].double().repeat_interleave(groups, dim=0)
    out = F.scaled_dot_product_attention(q.double()[None], K[None], V[None])
    return out[0].transpose(0, 1).reshape(1, Nq * q.shape[-1])


def attention_inputs(Nq, Nkv, D, max_tokens, dtype, seed):
    g = gen(seed)
    cache = randn(2, 2, Nkv, max_tokens, D, g=g, dtype=dtype)  # [k/v, layer, ...]: layer 1 is a view
    return randn(Nq, 1, D, g=g, dtype=dtype), cache[0, 1], cache[1, 1]


@pytest.mark.parametrize("Nq,Nkv,D,max_tokens,split", [
    (4, 2, 16, 40, 16),  # 3 splits, the last one partial
    (4, 2, 32, 130, 32),  # 5 splits
    (8, 2, 32, 130, 128),  # the default split: 2 splits, the second holds 2 keys
    (4, 4, 16, 64, 16),  # one query head per kv head
])
def test_decode_attention(td, Nq, Nkv, D, max_tokens, split):
    q, keys, values = attention_inputs(Nq, Nkv, D, max_tokens, torch.float32, seed=D + max_tokens)
    assert td.num_splits(max_tokens, split) == -(-max_tokens // split)
    for p in sorted({0, 1, split - 1, split, split + 1, max_tokens // 2, max_tokens - 1}):
        out = td.decode_attention(q, keys, values, torch.tensor([p]), split=split)
        assert out.shape == (1, Nq * D) and out.dtype == torch.float32
        assert relative_error(out, reference_attention(q, keys, values, p)) < TOL[torch.float32], p


def test_decode_attention_scale_and_bf16(td):
    q, keys, values = attention_inputs(4, 2, 32, 70, torch.bfloat16, seed=1)
    for p in (0, 33, 69):
        out = td.decode_attention(q, keys, values, torch.tensor([p]), split=32)
        assert out.dtype == torch.bfloat16
        assert relative_error(out, reference_attention(q, keys, values, p)) < TOL[torch.bfloat16]
    q, keys, values = attention_inputs(4, 2, 16, 40, torch.float32, seed=2)
    out = td.decode_attention(q, keys, values, torch.tensor([30]), scale=0.7, split=16)
    assert relative_error(out, reference_attention(q / 0.25 * 0.7, keys, values, 30)) < TOL[torch.float32]


def test_decode_attention_same_bits_every_run_and_cache_length(td):
    q, keys, values = attention_inputs(4, 2, 32, 130, torch.float32, seed=3)
    pos = torch.tensor([77])
    out = td.decode_attention(q, keys, values, pos, split=16)
    assert torch.equal(out, td.decode_attention(q, keys, values, pos, split=16))
    # a shorter cache holding the same first keys: other split count, same bits
    assert torch.equal(out, td.decode_attention(q, keys[:, :90], values[:, :90], pos, split=16))


# -- every sequence slot's caches in one tensor, the slot a device value ---------------------------------

def test_a_slot_index_writes_and_reads_that_slot_only_with_the_same_bits(td):
    """keys/values [S, Nkv, T, D] (one layer of a pooled cache: a strided view) and slot s give the
    bits the slot's own [Nkv, T, D] cache gives, and leave the other slots alone; an index out of
    range is clamped, never written out of bounds."""
    S, L, Nq, Nkv, D, max_tokens, layer = 3, 2, 4, 2, 32, 70, 1
    g = gen(11)
    pool_k, pool_v = randn(S, L, Nkv, max_tokens, D, g=g), randn(S, L, Nkv, max_tokens, D, g=g)
    inv_freq = Rope(D, THETA, torch.device("cpu")).inv_freq
    for s, p in ((0, 5), (2, 69), (1, 33)):
        q, k, v = randn(1, Nq * D, g=g), randn(1, Nkv * D, g=g), randn(1, Nkv * D, g=g)
        keys, values = pool_k.clone(), pool_v.clone()
        own_k, own_v = pool_k[s, layer].clone(), pool_v[s, layer].clone()
        pos = torch.tensor([p])
        got = td.rope_qk_store(q, k, v, pos, inv_freq, keys[:, layer], values[:, layer], slot=torch.tensor([s]))
        want = td.rope_qk_store(q, k, v, pos, inv_freq, own_k, own_v)
        assert torch.equal(got, want)
        assert torch.equal(keys[s, layer], own_k) and torch.equal(values[s, layer], own_v)
        others = torch.ones(S, L, dtype=torch.bool)
        others[s, layer] = False
        assert torch.equal(keys[others], pool_k[others]) and torch.equal(values[others], pool_v[others])
        qa = randn(Nq, 1, D, g=g)
        att = td.decode_attention(qa, keys[:, layer], values[:, layer], pos, split=32, slot=torch.tensor([s]))
        assert torch.equal(att, td.decode_attention(qa, own_k, own_v, pos, split=32))
    keys = pool_k.clone()
    td.rope_qk_store(q, k, v, torch.tensor([3]), inv_freq, keys[:, layer], pool_v.clone()[:, layer],
                     slot=torch.tensor([7]))  # clamped to the last slot
    assert not torch.equal(keys[S - 1, layer, :, 3], pool_k[S - 1, layer, :, 3])
    with pytest.raises(ValueError, match="with a slot"):
        td.decode_attention(qa, keys[0, layer], keys[0, layer], pos, slot=torch.tensor([0]))


# -- T rows at once -------------------------------------------------------------------------------------

@pytest.mark.parametrize("pooled", [False, True], ids=["one-cache", "pool"])
def test_rows_give_each_row_the_bits_it_gets_alone(td, pooled):
    """rope_qk_store_rows then decode_attention_rows over T rows (strided views of one fused qkv
    product, each row its own position and, pooled, its own sequence slot; later rows of a slot see
    the K/V earlier rows wrote) equal the one-row kernels run row after row, bit for bit; the
    output's padding rows are zero."""
    S, L, Nq, Nkv, D, max_tokens, layer = 3, 2, 4, 2, 32, 70, 1
    g = gen(12)
    inv_freq = Rope(D, THETA, torch.device("cpu")).inv_freq
    pool_k, pool_v = randn(S, L, Nkv, max_tokens, D, g=g), randn(S, L, Nkv, max_tokens, D, g=g)
    if pooled:
        slots, positions = [2, 0, 2, 1, 2], [9, 40, 10, 69, 11]
    else:
        slots, positions = [0] * 4, [30, 31, 32, 33]
    T, R = len(slots), 8
    qkv = randn(R, (Nq + 2 * Nkv) * D, g=g)
    q, k, v = qkv[:, :Nq * D], qkv[:, Nq * D:(Nq + Nkv) * D], qkv[:, (Nq + Nkv) * D:]
    qn, kn = randn(D, g=g), randn(D, g=g)
    pos, slot = torch.tensor(positions), torch.tensor(slots)

    def caches(keys, values):
        return (keys[:, layer], values[:, layer]) if pooled else (keys[0, layer], values[0, layer])

    keys, values = pool_k.clone(), pool_v.clone()
    where = {"slot": slot} if pooled else {}
    qo = td.rope_qk_store_rows(q[:T], k[:T], v[:T], pos, inv_freq, *caches(keys, values), q_norm=qn, k_norm=kn,
                               **where)
    out = td.decode_attention_rows(qo, *caches(keys, values), pos, out_rows=R, split=32, **where)
    ref_k, ref_v = pool_k.clone(), pool_v.clone()
    alone_q = []
    for t in range(T):
        one = {"slot": slot[t:t + 1]} if pooled else {}
        alone_q.append(td.rope_qk_store(q[t:t + 1], k[t:t + 1], v[t:t + 1], pos[t:t + 1], inv_freq,
                                        *caches(ref_k, ref_v), q_norm=qn, k_norm=kn, **one))
    assert torch.equal(keys, ref_k) and torch.equal(values, ref_v)
    for t in range(T):
        assert torch.equal(qo[t], alone_q[t][:, 0])
        one = {"slot": slot[t:t + 1]} if pooled else {}
        alone = td.decode_attention(alone_q[t], *caches(ref_k, ref_v), pos[t:t + 1], split=32, **one)
        assert torch.equal(out[t:t + 1], alone), t
    assert not out[T:].any()
    with pytest.raises(ValueError, match="slot tensor of"):
        td.decode_attention_rows(qo, keys[:, layer], values[:, layer], pos, slot=slot[:2])


def test_bad_arguments_are_refused(td):
    keys = torch.zeros(2, 32, 16)
    pos = torch.tensor([0])
    with pytest.raises(ValueError):
        td.rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), EPS)  # weight dtype
    with pytest.raises(ValueError):
        td.decode_attention(torch.zeros(3, 1, 16), keys, keys, pos)  # 3 query heads on 2 kv heads
    with pytest.raises(ValueError):
        td.decode_attention(torch.zeros(4, 1, 16), keys, keys, pos, split=24)
    with pytest.raises(ValueError):
        td.rope_qk_store(torch.zeros(1, 64), torch.zeros(1, 16), torch.zeros(1, 32), pos, torch.zeros(8), keys, keys)
