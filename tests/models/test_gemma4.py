"""Gemma 4: the text part of a multimodal checkpoint against transformers, the features this
family refuses, the experts' activation in the manifest, and synth of a gemma4_text shape."""
import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import UnsupportedModelError
from moestream.format.reader import PackedModel
from tiny import model_args
from tiny import FAMILY_CONFIGS, build_tokenizer

TEXT = FAMILY_CONFIGS["gemma4_text"]


def reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def multimodal_checkpoint(tmp_path_factory):
    """A gemma4 checkpoint with a vision tower beside the language model."""
    folder = tmp_path_factory.mktemp("hf-gemma4")
    vocab = build_tokenizer(folder)
    cfg = AutoConfig.for_model("gemma4", text_config=dict(TEXT, vocab_size=vocab, max_position_embeddings=256),
                               vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                                  num_attention_heads=2, num_key_value_heads=2, head_dim=16),
                               audio_config=None)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.08) if p.dim() >= 2 else p.uniform_(0.5, 1.5)
    model.save_pretrained(folder)
    return folder


def test_gemma4_checkpoint_runs_its_language_model(multimodal_checkpoint, tmp_path):
    from moestream.convert.main import convert

    packed = convert(multimodal_checkpoint, tmp_path / "packed", quant="none")
    names = PackedModel(packed).logical_dense_names()
    assert names and all(n.startswith("model.layers.") or n.startswith(("model.embed_tokens", "model.norm"))
                         for n in names)  # towers left out, language-model names as gemma4_text's
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    ref = reference(multimodal_checkpoint)
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    return")
    logits, _ = engine.prefill(prompt, all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-4
    ours = [e.token_id for e in engine.generate(prompt, max_new_tokens=12, stop_at_eos=False)]
    seq = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            seq.append(int(ref(torch.tensor([seq])).logits[0, -1].argmax()))
    assert ours == seq[len(prompt):]


@pytest.mark.parametrize("change, message", [
    (dict(hidden_size_per_layer_input=8), "per-layer input embeddings"),
    (dict(num_kv_shared_layers=2), "KV sharing"),
    (dict(enable_moe_block=False), "dense model"),
    (dict(use_bidirectional_attention="all"), "bidirectional"),
    (dict(hidden_activation="silu"), "hidden_activation"),
])
def test_features_not_built_are_refused_in_one_line(change, message):
    config = dict(TEXT, model_type="gemma4_text", vocab_size=320, **change)
    with pytest.raises(UnsupportedModelError, match=message) as info:
        model_args("gemma4_text", config)
    assert "\n" not in str(info.value)
    with pytest.raises(UnsupportedModelError, match=message):
        model_args("gemma4", {"model_type": "gemma4", "text_config": config})


def test_per_layer_shapes_follow_either_config_spelling():
    """per_layer_config (as transformers saves it) and global_head_dim / num_global_key_value_heads
    (as published checkpoints write it) give the same KV layout."""
    base = dict(TEXT, model_type="gemma4_text", vocab_size=320)
    spelled = model_args("gemma4_text", base)
    saved = {k: v for k, v in base.items() if k not in ("global_head_dim", "num_global_key_value_heads")}
    saved["per_layer_config"] = {"1": {"head_dim": 32, "num_key_value_heads": 1},
                                 "3": {"head_dim": 32, "num_key_value_heads": 1}}
    assert [(s.heads, s.k_dim) for s in spelled.kv_layout()] == [(2, 16), (1, 32), (2, 16), (1, 32)]
    assert model_args("gemma4_text", saved).kv_layout() == spelled.kv_layout()


def test_manifest_records_the_experts_gelu_activation(tiny_packed_model):
    manifest = json.loads((tiny_packed_model("gemma4_text", "q4") / "moestream.json").read_text())
    for entry in manifest["expert_layers"]:
        assert {spec["activation"] for spec in entry["quant"].values()} == {"gelu_tanh"}
    qwen = json.loads((tiny_packed_model("qwen3_moe", "q4") / "moestream.json").read_text())
    assert all("activation" not in spec for e in qwen["expert_layers"] for spec in e["quant"].values())


def test_synth_of_a_gemma4_text_shape_generates(tmp_path, monkeypatch):
    from moestream.bench.synth import SHAPES, synth

    shape = dict(TEXT, model_type="gemma4_text", vocab_size=512, max_position_embeddings=256, rms_norm_eps=1e-6,
                 eos_token_id=0)
    monkeypatch.setitem(SHAPES, "tiny-gemma4", shape)
    out = synth("tiny-gemma4", tmp_path / "m", quant="q4")
    packed = PackedModel(out)
    assert packed.manifest.expert_layers[0].quant["gate_proj"]["activation"] == "gelu_tanh"
    engine = Engine.load(out, options=EngineOptions(device="cpu", threads=1))
    try:
        tokens = [e.token_id for e in engine.generate([5, 17, 42, 99, 300], max_new_tokens=6, stop_at_eos=False)]
        assert len(tokens) == 6 and all(0 <= t < 512 for t in tokens)
    finally:
        engine.close()
