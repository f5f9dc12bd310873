"""Attention with sink logits, a sliding window, output bias and YaRN rotary against gpt-oss's
attention in transformers (each layer kind), in one prefill, in chunks and one token at a time."""
import pytest
import torch

from moestream.kv.layout import LayerKV
from moestream.layers.attention import Attention, AttentionWeights
from moestream.layers.rope import Rope, rope_parameters
from tests.paged import pool_for, run_chunks

WINDOW, T = 4, 11


def reference():
    from transformers import GptOssConfig, GptOssModel

    cfg = GptOssConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                       layer_types=["sliding_attention", "full_attention"], vocab_size=50, max_position_embeddings=256)
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    model = GptOssModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "self_attn" in name:
                p.normal_(0.0, 0.3)
    seen = {}
    for i, layer in enumerate(model.layers):
        layer.self_attn.register_forward_hook(
            lambda mod, args, kwargs, out, i=i: seen.__setitem__(i, (kwargs["hidden_states"][0], out[0][0])),
            with_kwargs=True)
    with torch.no_grad():
        model(torch.randint(0, 50, (1, T)))
    return cfg, model, seen


def ours(cfg, module, window):
    a = module.self_attn
    w = AttentionWeights(q=a.q_proj.weight.detach(), k=a.k_proj.weight.detach(), v=a.v_proj.weight.detach(),
                         o=a.o_proj.weight.detach(), q_bias=a.q_proj.bias.detach(), k_bias=a.k_proj.bias.detach(),
                         v_bias=a.v_proj.bias.detach(), o_bias=a.o_proj.bias.detach(), sinks=a.sinks.detach())
    w.fuse_qkv()
    rope = Rope.from_params(rope_parameters(cfg.to_dict()), 16, cfg.max_position_embeddings, torch.device("cpu"))
    return Attention(w, rope, num_heads=4, num_kv_heads=2, head_dim=16, qk_norm=None, eps=1e-5, window=window)


@pytest.mark.parametrize("layer", [0, 1])
def test_sinks_window_and_yarn_match_gpt_oss_attention(layer):
    cfg, model, seen = reference()
    assert rope_parameters(cfg.to_dict())["rope_type"] == "yarn"
    x, expected = seen[layer]
    attn = ours(cfg, model.layers[layer], WINDOW if cfg.layer_types[layer] == "sliding_attention" else None)
    assert not attn.rope.plain
    window = attn.window

    def run(chunks, block_size):
        return run_chunks(attn, x, pool_for([LayerKV(2, 16, window=window)], block_size=block_size), chunks)

    with torch.no_grad():
        whole, chunked, steps = run([T], 16), run([5, 6], 3), run([1] * T, 2)
    # every row alone: the same bits whatever the chunks and the block size
    assert torch.equal(whole, chunked) and torch.equal(whole, steps)
    for got in (whole, chunked, steps):  # outputs reach ~7: float32 rounding relative to that
        assert (got - expected).abs().max() < 1e-5 * expected.abs().max() * 10, (got - expected).abs().max()


def test_without_sinks_the_window_alone_changes_only_positions_past_it():
    cfg, model, seen = reference()
    x, _ = seen[0]
    windowed, full = ours(cfg, model.layers[0], WINDOW), ours(cfg, model.layers[0], None)
    with torch.no_grad():
        a = run_chunks(windowed, x, pool_for([LayerKV(2, 16, window=WINDOW)], block_size=2), [T])
        b = run_chunks(full, x, pool_for([LayerKV(2, 16)]), [T])
    assert torch.allclose(a[:WINDOW], b[:WINDOW], atol=1e-6)
    assert not torch.allclose(a[WINDOW:], b[WINDOW:], atol=1e-4)
