"""Latent attention's pieces against transformers' and against each other: YaRN frequencies and
scales, DeepSeek's routing, the absorbed decode form against the expanded one."""
import math

import pytest
import torch
from transformers import AutoConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter, yarn_apply_mscale

from moestream.errors import UnsupportedModelError
from moestream.layers.mla import MLAShape, MLAttention, MLAWeights
from moestream.layers.rope import Rope, rope_theta, yarn_inv_freq_and_scale, yarn_softmax_scale
from moestream.layers.routers import sigmoid_topk
from tiny import model_args
from tests.paged import pool_for, run_chunks

YARN = [
    dict(factor=40, original_max_position_embeddings=4096, mscale=1.0, mscale_all_dim=1.0, beta_fast=32, beta_slow=1),
    dict(factor=4, original_max_position_embeddings=64, mscale=1.0, mscale_all_dim=0.7),
    dict(factor=8, original_max_position_embeddings=128, attention_factor=1.3, beta_fast=16, beta_slow=2, truncate=False),
    dict(factor=2, original_max_position_embeddings=64),
]


@pytest.mark.parametrize("params", YARN)
def test_yarn_matches_transformers(params):
    rope = dict(rope_type="yarn", rope_theta=10000.0, **params)
    cfg = AutoConfig.for_model("deepseek_v3", qk_rope_head_dim=64, max_position_embeddings=8192, rope_parameters=rope)
    want_freq, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg, "cpu")
    config = {"rope_parameters": rope, "max_position_embeddings": 8192}
    inv_freq, scale = yarn_inv_freq_and_scale(config, 64, 10000.0)
    torch.testing.assert_close(inv_freq, want_freq, rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)
    assert yarn_softmax_scale(config) == pytest.approx(yarn_apply_mscale(rope, 1.0), rel=1e-12)
    # transformers 4 spelled the kind "type" under rope_scaling: the same numbers
    old = {"rope_scaling": dict(type="yarn", **params), "max_position_embeddings": 8192}
    assert torch.equal(yarn_inv_freq_and_scale(old, 64, 10000.0)[0], inv_freq)


def test_yarn_scales_cos_and_sin():
    inv_freq, factor = yarn_inv_freq_and_scale({"rope_scaling": dict(type="yarn", **YARN[2])}, 16, 10000.0)
    plain = Rope(16, 10000.0, torch.device("cpu"), inv_freq=inv_freq)
    scaled = Rope(16, 10000.0, torch.device("cpu"), inv_freq=inv_freq, scale=factor)
    pos = torch.arange(5)
    assert torch.allclose(scaled.cos_sin(pos, torch.float32)[1], plain.cos_sin(pos, torch.float32)[1] * 1.3)


def test_families_without_yarn_refuse_it_in_one_line():
    config = {"rope_scaling": {"type": "yarn", "factor": 4}, "rope_theta": 1e6}
    with pytest.raises(UnsupportedModelError, match="rope type 'yarn' is not supported"):
        rope_theta(config)
    assert rope_theta(config, supported=("default", "yarn")) == 1e6
    assert yarn_softmax_scale({"rope_theta": 1e6}) == 1.0


@pytest.mark.parametrize("groups, keep, normalize", [(4, 2, True), (8, 3, False), (1, 1, True)])
def test_sigmoid_group_routing_matches_transformers(groups, keep, normalize):
    torch.manual_seed(groups)
    cfg = AutoConfig.for_model("deepseek_v3", hidden_size=32, n_routed_experts=16, num_experts_per_tok=4,
                               n_group=groups, topk_group=keep, norm_topk_prob=normalize, routed_scaling_factor=2.5)
    router = DeepseekV3TopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(64, 32)
    _, want_w, want_ids = router(x)
    weights, ids = sigmoid_topk(x @ router.weight.T, 4, correction_bias=router.e_score_correction_bias,
                                      n_group=groups, topk_group=keep, normalize=normalize, scaling=2.5,
                                      out_dtype=torch.float32)
    order, want_order = ids.sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(weights.gather(1, order.indices), want_w.gather(1, want_order.indices))
    # the chosen experts lie in at most `keep` groups
    assert all(len(set((row // (16 // groups)).tolist())) <= keep for row in ids)


def _random_mla(*, q_lora: bool, interleaved: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    s = MLAShape(num_heads=4, kv_lora_rank=32, nope_dim=16, rope_dim=8, v_dim=12)
    H, qk = 48, s.nope_dim + s.rope_dim

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    w = MLAWeights(kv_a=r(s.kv_lora_rank + s.rope_dim, H), kv_a_norm=1 + r(s.kv_lora_rank), o=r(H, s.num_heads * s.v_dim),
                   kv_b=r(s.num_heads * (s.nope_dim + s.v_dim), s.kv_lora_rank))
    if q_lora:
        w.q_a, w.q_a_norm, w.q_b = r(24, H), 1 + r(24), r(s.num_heads * qk, 24)
    else:
        w.q = r(s.num_heads * qk, H)
    rope = Rope(s.rope_dim, 10000.0, torch.device("cpu"))
    return MLAttention(w, rope, s, scale=1 / math.sqrt(qk), eps=1e-6, interleaved=interleaved), H


@pytest.mark.parametrize("q_lora", [True, False])
@pytest.mark.parametrize("interleaved", [True, False])
def test_absorbed_forward_equals_expanded_attention(q_lora, interleaved):
    """Each row of the forward (absorbed, over the latent rows in the pool's blocks) gives what the
    expanded form gives over the same rows; one-token steps give the bits of one pass."""
    attn, H = _random_mla(q_lora=q_lora, interleaved=interleaved)
    layout = [attn.shape.cache_layout()]
    x = torch.randn(10, H, generator=torch.Generator().manual_seed(1))
    pool = pool_for(layout, context=16, block_size=4)
    assert pool.layer(0).keys.shape == (4, 4, 1, 32 + 8) and pool.layer(0).values is None
    whole = run_chunks(attn, x, pool)
    stepped = run_chunks(attn, x, pool_for(layout, context=16, block_size=3), [1] * 10)
    assert torch.equal(stepped, whole)
    rows = pool.layer(0).gather(0, 0, 10)[0][:, 0]  # [10, R + Dr]
    cos, sin = attn.rope.cos_sin(torch.arange(10), torch.float32)
    q_nope, q_rot = attn._query(x, cos, sin)
    mask = torch.ones(10, 10, dtype=torch.bool).tril()
    expanded = attn._out(attn.attend_expanded(q_nope, q_rot, rows, mask=mask, causal=False))
    torch.testing.assert_close(whole, expanded, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(expanded[9:], attn._out(attn.attend_expanded(q_nope[:, 9:], q_rot[:, 9:], rows[:9],
                                                                           mask=None, causal=False)))


def test_chunked_prefill_equals_one_prefill():
    attn, H = _random_mla(q_lora=True, interleaved=True, seed=3)
    layout = [attn.shape.cache_layout()]
    x = torch.randn(9, H, generator=torch.Generator().manual_seed(2))
    whole = run_chunks(attn, x, pool_for(layout, context=16), [9])
    parts = run_chunks(attn, x, pool_for(layout, context=16, block_size=2), [4, 1, 4])
    assert torch.equal(parts, whole)


def test_config_reading_and_refusals():
    base = dict(model_type="deepseek_v3", hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                vocab_size=100, num_experts_per_tok=2, n_routed_experts=8, moe_intermediate_size=32,
                first_k_dense_replace=1, moe_layer_freq=2, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=16, q_lora_rank=None)
    args = model_args("deepseek_v3", base)
    assert args.num_experts == 8 and args.moe_layers() == [2] and args.head_dim == 24
    assert [(s.heads, s.k_dim, s.value_heads * s.value_dim) for s in args.kv_layout()] == [(1, 40, 0)] * 4
    with pytest.raises(UnsupportedModelError, match="n_group 3"):
        model_args("deepseek_v3", dict(base, n_group=3, topk_group=1))
    with pytest.raises(UnsupportedModelError, match="routing softmax"):
        model_args("deepseek_v3", dict(base, scoring_func="softmax"))
    with pytest.raises(UnsupportedModelError, match="rope type 'linear'"):
        model_args("deepseek_v3", dict(base, rope_scaling={"type": "linear", "factor": 2}))
