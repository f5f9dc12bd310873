"""Text-only saves of the multimodal families: each converts under the model_type its config carries,
to the packed tensors of the multimodal checkpoint it came from, and matches transformers; the text
model_types of multimodal families not supported here are refused in one line naming the type."""
import json

import pytest
import torch
from models.test_parity import check_against, load_reference
from tiny import load_all, save_language_model

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import UnsupportedModelError
from moestream.format.reader import PackedModel
from moestream.models import qwen3_5_moe_text
from tiny import model_args

# (multimodal family, how its language model is saved, the model_type that save carries, the
# spelling of its language model's names)
SAVES = [
    ("qwen3_5_moe", "alone", "qwen3_5_moe_text", "model.layers."),
    ("qwen3_5_moe", "loaded", "qwen3_5_moe_text", "model.language_model.layers."),
    ("gemma4", "alone", "gemma4_text", "model.layers."),
    ("kimi_k25", "alone", "deepseek_v3", "model.layers."),
]
# transformers' text model_types of multimodal MoE families whose multimodal type is not supported
UNSUPPORTED = ["qwen3_vl_moe_text", "glm4v_moe_text", "llama4_text", "ernie4_5_vl_moe_text", "qwen3_omni_moe_text",
               "qwen3_5_text", "gemma4_unified_text", "minimax_m3_vl_text"]


@pytest.mark.parametrize("multimodal, how, model_type, layers", SAVES)
def test_text_only_save_converts_to_the_multimodal_language_model(multimodal, how, model_type, layers, tiny_checkpoint,
                                                                  tiny_packed_model, tmp_path):
    folder = save_language_model(tiny_checkpoint(multimodal), tmp_path / "hf", alone=how == "alone")
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == model_type and "text_config" not in config
    assert any(n.startswith(layers) for n in load_all(folder))
    packed = convert(folder, tmp_path / "packed", quant="none", progress=False)
    got, want = PackedModel(packed), PackedModel(tiny_packed_model(multimodal, "none"))
    assert got.family == model_type
    assert sorted(got.logical_dense_names()) == sorted(want.logical_dense_names())
    for name in want.logical_dense_names():
        assert torch.equal(got.dense(name), want.dense(name)), name
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    try:
        check_against(engine, load_reference(folder))
    finally:
        engine.close()


def test_sanitize_reads_both_spellings_and_leaves_the_tower_out():
    for name in ("model.language_model.layers.3.mlp.gate.weight", "model.layers.3.mlp.gate.weight"):
        assert qwen3_5_moe_text.sanitize(name) == "model.layers.3.mlp.gate.weight"
    assert qwen3_5_moe_text.sanitize("model.language_model.norm.weight") == "model.norm.weight"
    assert qwen3_5_moe_text.sanitize("mtp.fc.weight") == "mtp.fc.weight"
    for dropped in ("model.visual.blocks.0.attn.qkv.weight", "model.language_model.rotary_emb.inv_freq",
                    "model.rotary_emb.inv_freq"):
        assert qwen3_5_moe_text.sanitize(dropped) is None


def test_settings_at_the_top_level_or_nested_read_the_same(tiny_checkpoint):
    nested = json.loads((tiny_checkpoint("qwen3_5_moe") / "config.json").read_text())
    flat = {**nested["text_config"], "model_type": "qwen3_5_moe_text", "tie_word_embeddings": False}
    a = model_args("qwen3_5_moe_text", flat)
    b = model_args("qwen3_5_moe_text", {**nested, "model_type": "qwen3_5_moe_text"})
    c = model_args("qwen3_5_moe", nested)
    assert a.layer_types == b.layer_types == c.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (a.num_experts, a.hidden_size, a.kv_layout()) == (c.num_experts, c.hidden_size, c.kv_layout())
    assert a.model_type == b.model_type == "qwen3_5_moe_text" and c.model_type == "qwen3_5_moe"


@pytest.mark.parametrize("model_type", UNSUPPORTED)
def test_unsupported_text_types_are_refused_in_one_line(model_type, tmp_path):
    from transformers import AutoConfig

    AutoConfig.for_model(model_type).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedModelError, match=f"model_type '{model_type}' is not supported") as info:
        convert(tmp_path, tmp_path / "packed", quant="none", progress=False)
    assert "\n" not in str(info.value)
