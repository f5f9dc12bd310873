"""gpt-oss specifics: convert de-interleaves the fused expert stacks and keeps their biases, the
clamped SwiGLU's settings are recorded per layer, and bad inputs are refused in one line."""
import shutil

import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from moestream.layers.torch_experts import activation_of
from moestream.models import gpt_oss
from moestream.quant.affine import QuantSpec
from tests.tiny import FAMILY_CONFIGS, load_all


def test_records_hold_deinterleaved_projections_and_biases(tiny_checkpoint, tiny_packed_model):
    source = load_all(tiny_checkpoint("gpt_oss"))
    packed = PackedModel(tiny_packed_model("gpt_oss", "none"))
    for layer in (0, 1):
        p = f"model.layers.{layer}.mlp.experts."
        for e in (0, 5):
            record = packed.expert_tensors(layer, e)
            gate_up, bias = source[p + "gate_up_proj"][e], source[p + "gate_up_proj_bias"][e]  # [H, 2I], [2I]
            assert torch.equal(record["gate_proj.weight"], gate_up[:, 0::2].T)
            assert torch.equal(record["up_proj.weight"], gate_up[:, 1::2].T)
            assert torch.equal(record["down_proj.weight"], source[p + "down_proj"][e].T)
            assert torch.equal(record["gate_proj.bias"], bias[0::2])
            assert torch.equal(record["up_proj.bias"], bias[1::2])
            assert torch.equal(record["down_proj.bias"], source[p + "down_proj_bias"][e])
        assert not any(n.startswith(p) for n in packed.logical_dense_names())  # no stack left resident
        spec = QuantSpec.from_json(packed.expert_layer(layer).quant["gate_proj"])
        assert (spec.activation, spec.alpha, spec.limit) == ("clamped_swiglu", 1.702, FAMILY_CONFIGS["gpt_oss"]["swiglu_limit"])


def test_router_keeps_eight_bits_in_q4(tiny_packed_model):
    packed = PackedModel(tiny_packed_model("gpt_oss", "q4"))
    tensors = packed.manifest.quantization["tensors"]
    assert tensors["model.layers.0.mlp.router.weight"]["bits"] == 8
    assert tensors["model.layers.0.self_attn.q_proj.weight"]["bits"] == 4
    assert QuantSpec.from_json(packed.expert_layer(0).quant["down_proj"]).bits == 4


def test_stack_in_the_wrong_orientation_is_named(tiny_checkpoint, tmp_path):
    src = shutil.copytree(tiny_checkpoint("gpt_oss"), tmp_path / "src")
    tensors = load_all(src)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name].transpose(1, 2).contiguous()  # [E, 2I, H]: not gpt-oss's x @ W layout
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(MoestreamError, match=rf"{name}: shape \[8, 128, 64\], but config\.json implies \[8, 64, 128\]") as info:
        convert(src, tmp_path / "out", progress=False)
    assert "\n" not in str(info.value)


def test_missing_expert_bias_is_named(tiny_checkpoint, tmp_path):
    src = shutil.copytree(tiny_checkpoint("gpt_oss"), tmp_path / "src")
    tensors = load_all(src)
    del tensors["model.layers.0.mlp.experts.down_proj_bias"]
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(MoestreamError, match=r"model\.layers\.0\.mlp\.experts\.down_proj_bias is missing"):
        convert(src, tmp_path / "out", progress=False)


def test_clamped_swiglu_without_its_settings_is_refused():
    quant = {p: QuantSpec(activation="clamped_swiglu") for p in ("gate_proj", "up_proj", "down_proj")}
    with pytest.raises(ValueError, match="need its alpha and limit"):
        activation_of(quant)


def test_settings_come_from_the_config():
    assert gpt_oss.expert_activation_params({"swiglu_alpha": 2.0, "swiglu_limit": 3.0}) == {"alpha": 2.0, "limit": 3.0}


def test_cpu_runs_4_bit_experts_in_the_native_kernels(tiny_packed_model):
    """The CPU computes gpt-oss's 4-bit records in the native kernels (clamped SwiGLU, added biases),
    so it keeps no dequantized copies of them (test_parity checks the answers)."""
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions
    from moestream.layers.native_experts import takes_every_layer

    packed = tiny_packed_model("gpt_oss", "q4")
    assert takes_every_layer(PackedModel(packed))
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    assert all(layout is not None for layout in engine.experts.native.values())
    assert engine.experts.unpacked is None
    engine.close()
