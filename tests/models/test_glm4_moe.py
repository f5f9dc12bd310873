"""glm4_moe specifics beyond parity: the multi-token-prediction layer real checkpoints carry, and
a bfloat16 model keeps the router's correction bias in float32."""
import shutil

import torch
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel


def test_the_prediction_layer_past_num_hidden_layers_is_left_out(tiny_checkpoint, tiny_packed_model, tmp_path):
    folder = tmp_path / "hf"
    shutil.copytree(tiny_checkpoint("glm4_moe"), folder)
    H, E = 64, 8
    extra = {"model.layers.3.eh_proj.weight": torch.randn(H, 2 * H), "model.layers.3.enorm.weight": torch.ones(H),
             "model.layers.3.mlp.gate.weight": torch.randn(E, H),
             **{f"model.layers.3.mlp.experts.{e}.{p}.weight": torch.randn(64, 64)
                for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}}
    save_file(extra, str(folder / "mtp.safetensors"))
    packed = convert(folder, tmp_path / "packed", quant="none")
    assert not [n for n in PackedModel(packed).dense_names if ".layers.3." in n]
    plain = Engine.load(tiny_packed_model("glm4_moe", "none"), options=EngineOptions(device="cpu"))
    with_mtp = Engine.load(packed, options=EngineOptions(device="cpu"))
    prompt = plain.tokenizer.encode("def fibonacci(n):")
    assert torch.equal(plain.prefill(prompt)[0], with_mtp.prefill(prompt)[0])


def test_bfloat16_keeps_the_correction_bias_in_float32(tiny_packed_model):
    engine = Engine.load(tiny_packed_model("glm4_moe", "none"), options=EngineOptions(device="cpu", dtype="bfloat16"))
    moe = engine.model.layers[1].ffn
    bias = moe.route_fn.args[1]
    assert bias.dtype == torch.float32 and moe.router.dtype == torch.bfloat16
    assert bias.abs().sum() > 0
