"""minimax_m2 specifics beyond parity: released checkpoints give partial rotary as `rotary_dim`
only, the router keeps eight bits at q4, and a bfloat16 model keeps the correction bias in float32."""
import json
import shutil

import torch

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from moestream.models.minimax_m2 import ModelArgs
from tests.models.test_parity import check_against, load_reference


def test_rotary_dim_alone_gives_the_partial_rotary(tiny_checkpoint, tmp_path):
    src = shutil.copytree(tiny_checkpoint("minimax_m2"), tmp_path / "src")
    config = json.loads((src / "config.json").read_text())
    config["rope_parameters"].pop("partial_rotary_factor")  # as the released config.json spells it
    (src / "config.json").write_text(json.dumps(config))
    args = ModelArgs.from_dict(config)
    assert args.rope_parameters["partial_rotary_factor"] == config["rotary_dim"] / config["head_dim"] == 0.25
    engine = Engine.load(convert(src, tmp_path / "packed", quant="none", progress=False),
                         options=EngineOptions(device="cpu"))
    check_against(engine, load_reference(src))


def test_router_keeps_eight_bits_in_q4(tiny_packed_model):
    tensors = PackedModel(tiny_packed_model("minimax_m2", "q4")).manifest.quantization["tensors"]
    assert tensors["model.layers.0.block_sparse_moe.gate.weight"]["bits"] == 8
    assert tensors["model.layers.0.self_attn.q_proj.weight"]["bits"] == 4


def test_bfloat16_keeps_the_correction_bias_in_float32(tiny_packed_model):
    engine = Engine.load(tiny_packed_model("minimax_m2", "none"), options=EngineOptions(device="cpu", dtype="bfloat16"))
    moe = engine.model.layers[1].ffn
    bias = moe.route_fn.args[1]
    assert bias.dtype == torch.float32 and bias.abs().sum() > 0
    weights, _ = moe.route(torch.randn(3, 64, dtype=torch.bfloat16))
    assert weights.dtype == torch.float32  # the top-k weights stay float32, as transformers keeps them
