"""The attention kinds' CUDA path (the paged Triton kernels: store, then decode or prefill attention)
under Triton's CPU interpreter: GQA with windows, sinks and soft-caps, and latent attention with its
values a view of the latent rows, give the CPU path's rows over the same pool, and zero past T.

Runs in CI's interpreter stage (TRITON_INTERPRET=1)."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter import interpreted_module  # noqa: E402
from moestream.kv.layout import LayerKV  # noqa: E402
from moestream.layers.attention import Attention, AttentionWeights  # noqa: E402
from moestream.layers.rope import Rope, apply_rope  # noqa: E402
from tests.paged import pool_for  # noqa: E402


@pytest.fixture(scope="module")
def pa():
    return interpreted_module("moestream.kernels.triton_paged_attention")


@pytest.mark.parametrize("window,sinks,softcap,T", [(None, False, None, 5), (5, True, None, 5), (None, False, 20.0, 20),
                                                    (7, True, 30.0, 20)])
def test_gqa_on_the_kernels_gives_the_cpu_rows(pa, window, sinks, softcap, T):
    g = torch.Generator().manual_seed(T + (window or 0))
    H, Nq, Nkv, D = 32, 4, 2, 16
    w = AttentionWeights(q=torch.randn(Nq * D, H, generator=g) / 4, k=torch.randn(Nkv * D, H, generator=g) / 4,
                         v=torch.randn(Nkv * D, H, generator=g) / 4, o=torch.randn(H, Nq * D, generator=g) / 4,
                         sinks=torch.randn(Nq, generator=g) if sinks else None)
    w.fuse_qkv()
    attn = Attention(w, Rope(D, 1e4, torch.device("cpu")), num_heads=Nq, num_kv_heads=Nkv, head_dim=D, eps=1e-6,
                     window=window, softcap=softcap)
    pools = [pool_for([LayerKV(Nkv, D, window=window)], context=64, sequences=2, block_size=4) for _ in range(2)]
    for s, pool in enumerate(pools):  # the same earlier rows of sequence 1, in other physical blocks
        pool.sequences[0].reserve(0, 8 * s)
        pool.sequences[1].reserve(0, 10 + T)
        layer = pool.layer(0)
        ref_rows = torch.randn(10, Nkv, D, generator=torch.Generator().manual_seed(5))
        layer.write(torch.arange(10), torch.ones(10, dtype=torch.long), ref_rows, ref_rows * 2)
    x = torch.randn(T, H, generator=g)
    pos, seqs = torch.arange(10, 10 + T), torch.ones(T, dtype=torch.long)
    q, k, v, _ = attn._project(x, torch.nn.functional.linear)
    cos, sin = attn.rope.cos_sin(pos, x.dtype)
    q, k = apply_rope(q.transpose(0, 1), cos, sin), apply_rope(k.transpose(0, 1), cos, sin).transpose(0, 1)
    pools[0].layer(0).write(pos, seqs, k, v)
    want = attn._attend_cpu(q, pos, seqs, pools[0].layer(0))
    got = attn._attend_cuda(q.transpose(0, 1), k, v, pos, seqs, pools[1].layer(0), T + 3)
    assert (got[:T] - want).abs().max() < 1e-5 * want.abs().max() * 10 and not got[T:].any()
    for a, b in zip(pools[0].layer(0).gather(1, 0, 10 + T), pools[1].layer(0).gather(1, 0, 10 + T)):
        assert torch.equal(a, b)  # store_kv wrote what the torch write wrote


def test_latent_values_as_a_view_of_the_keys(pa):
    from tests.unit.test_mla import _random_mla
    from tests.paged import run_chunks

    attn, H = _random_mla(q_lora=True, interleaved=True)
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(1))
    pool = pool_for([attn.shape.cache_layout()], context=16, block_size=4)
    want = run_chunks(attn, x, pool)
    kv, s = pool.layer(0), attn.shape
    pos, seqs = torch.arange(10), torch.zeros(10, dtype=torch.long)
    cos, sin = attn.rope.cos_sin(pos, x.dtype)
    q_nope, q_rot = attn._query(x, cos, sin)
    query = torch.cat((torch.matmul(q_nope, attn.k_up), q_rot), dim=-1)
    latent = pa.paged_attention(query.transpose(0, 1), kv.keys, kv.keys[..., :s.kv_lora_rank], kv.block_table, pos,
                                seqs, scale=attn.scale, out_rows=12)
    got = attn._out(torch.matmul(latent.view(-1, s.num_heads, s.kv_lora_rank).transpose(0, 1),
                                 attn.v_up.transpose(1, 2)))
    torch.testing.assert_close(got[:10], want, rtol=1e-4, atol=1e-5)
