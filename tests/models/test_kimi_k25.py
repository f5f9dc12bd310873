"""Kimi K2.5: the DeepSeek-V3 language model of a multimodal checkpoint against transformers
(text-only input), float32 and q4, under either spelling of the language model's names."""
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForImageTextToText

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import FormatError
from moestream.convert.export_hf import export_hf
from moestream.format.reader import PackedModel
from moestream.models import kimi_k25
from tiny import model_args
from tiny import load_all

STEPS = 24


def reference(folder):
    return AutoModelForImageTextToText.from_pretrained(folder, attn_implementation="eager",
                                                       experts_implementation="eager", dtype=torch.float32).eval()


def check_against(packed, ref):
    """Prompt log-probabilities within 1e-4 and the same greedy tokens over STEPS steps."""
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    try:
        prompt = engine.tokenizer.encode("def fibonacci(n):\n    return")
        logits, _ = engine.prefill(prompt, all_logits=True)
        with torch.no_grad():
            expected = ref(input_ids=torch.tensor([prompt])).logits[0].log_softmax(-1)
        assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-4
        ours = [e.token_id for e in engine.generate(prompt, max_new_tokens=STEPS, stop_at_eos=False)]
        seq = list(prompt)
        with torch.no_grad():
            for _ in range(STEPS):
                seq.append(int(ref(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
        assert ours == seq[len(prompt):]
    finally:
        engine.close()


def test_float32_matches_transformers(tiny_checkpoint, tiny_packed_model):
    folder = tiny_checkpoint("kimi_k25")
    src = load_all(folder)
    assert any(n.startswith("vision_tower.") for n in src) and any("mm_projector" in n for n in src)
    packed = tiny_packed_model("kimi_k25", "none")
    names = PackedModel(packed).logical_dense_names()
    # the tower and projector left out; the language model named as deepseek_v3 names it
    assert "lm_head.weight" in names
    assert all(n == "lm_head.weight" or n.startswith(("model.layers.", "model.embed_tokens", "model.norm"))
               for n in names)
    check_against(packed, reference(folder))


def test_q4_matches_transformers_on_dequantized_weights(tiny_packed_model, tmp_path, float_activations):
    packed = tiny_packed_model("kimi_k25", "q4")
    check_against(packed, reference(export_hf(packed, tmp_path / "hf")))


def test_both_spellings_of_the_language_model_give_the_same_model(tiny_checkpoint, tiny_packed_model, tmp_path):
    """The published `language_model.model.layers.*` and transformers' `model.language_model.layers.*`
    convert to the same packed model as the checkpoint transformers saved."""
    folder = tiny_checkpoint("kimi_k25")
    src = load_all(folder)
    want = PackedModel(tiny_packed_model("kimi_k25", "none"))
    for spelling, head in (("language_model.model.layers.", "language_model.lm_head.weight"),
                           ("model.language_model.layers.", "lm_head.weight")):
        renamed = {}
        for name, t in src.items():
            if name == "language_model.lm_head.weight":
                name = head
            elif name.startswith("language_model.model."):
                rest = name[len("language_model.model."):].replace("blocks.", "layers.", 1)
                name = spelling.replace("layers.", "") + rest
            renamed[name] = t
        out = tmp_path / spelling.replace(".", "-")
        out.mkdir()
        for f in folder.iterdir():
            if f.suffix != ".safetensors":
                (out / f.name).write_bytes(f.read_bytes())
        save_file(renamed, str(out / "model.safetensors"), metadata={"format": "pt"})
        got = PackedModel(convert(out, tmp_path / f"packed-{spelling}", quant="none", progress=False))
        assert sorted(got.logical_dense_names()) == sorted(want.logical_dense_names())
        for name in want.logical_dense_names():
            assert torch.equal(got.dense(name), want.dense(name)), name


def test_sanitize_keeps_the_language_model_only():
    assert kimi_k25.sanitize("language_model.model.layers.3.mlp.gate.weight") == "model.layers.3.mlp.gate.weight"
    assert kimi_k25.sanitize("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert kimi_k25.sanitize("language_model.lm_head.weight") == "lm_head.weight"
    for tower in ("vision_tower.encoder.blocks.0.wqkv.weight", "mm_projector.proj.0.weight",
                  "model.mm_projector.pre_norm.bias", "model.vision_tower.layers.0.attn.q_proj.weight"):
        assert kimi_k25.sanitize(tower) is None
    assert kimi_k25.checkpoint_name("model.layers.3.mlp.gate.weight") == "language_model.model.layers.3.mlp.gate.weight"
    assert kimi_k25.checkpoint_name("lm_head.weight") == "language_model.lm_head.weight"


def test_a_config_without_text_config_is_refused_in_one_line():
    with pytest.raises(FormatError, match="no text_config") as info:
        model_args("kimi_k25", {"model_type": "kimi_k25", "hidden_size": 64})
    assert "\n" not in str(info.value)
