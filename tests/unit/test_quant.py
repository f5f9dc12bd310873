"""Affine group quantization in MLX's layout, and the MLX quantization config."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moestream.errors import MoestreamError
from moestream.quant import affine
from moestream.quant.affine import QuantSpec, can_quantize, dequantize, pack, packed_shape, quantize, unpack
from moestream.quant.mlx import MlxQuantization, mlx_input_size


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from([2, 4, 8]), rows=st.integers(1, 5), words=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_pack_unpack_round_trip(bits, rows, words, seed):
    g = torch.Generator().manual_seed(seed)
    cols = words * 32 // bits
    codes = torch.randint(0, 1 << bits, (rows, cols), generator=g)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint32 and tuple(packed.shape) == (rows, words)
    assert torch.equal(unpack(packed, bits).to(torch.int64), codes)


def test_pack_is_least_significant_first():
    codes = torch.arange(8).reshape(1, 8)  # 4-bit codes 0..7 -> nibbles 0x76543210
    assert pack(codes, 4).view(torch.int32).item() == 0x76543210
    assert pack(torch.tensor([[1, 2, 3, 255]]), 8).view(torch.int32).item() & 0xFFFFFFFF == (255 << 24) | (3 << 16) | (2 << 8) | 1


@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("group_size", [32, 64])
def test_error_within_half_a_step(bits, group_size):
    w = torch.randn(48, 256, generator=torch.Generator().manual_seed(bits)) * 0.1
    weight, scales, biases = quantize(w, bits, group_size)
    (w_shape, s_shape) = packed_shape(48, 256, bits, group_size)
    assert tuple(weight.shape) == w_shape and tuple(scales.shape) == s_shape == tuple(biases.shape)
    deq = dequantize(weight, scales, biases, bits, group_size)
    err = (w - deq).abs().reshape(48, -1, group_size)
    bound = scales[..., None] / 2 + 1e-6
    assert bool((err <= bound).all())


def test_bf16_scales_and_biases_keep_the_source_dtype():
    w = (torch.randn(8, 128) * 0.05).to(torch.bfloat16)
    weight, scales, biases = quantize(w, 4, 64)
    assert scales.dtype == biases.dtype == torch.bfloat16
    deq = dequantize(weight, scales, biases, 4, 64)
    step = scales.float()[..., None]
    assert bool(((w.float() - deq).abs().reshape(8, 2, 64) <= step / 2 + step * 0.02 + 1e-3).all())


def test_chunked_rows_equal_whole_matrix(monkeypatch):
    w = torch.randn(37, 128)
    whole = quantize(w, 4, 64)
    monkeypatch.setattr(affine, "QUANT_BLOCK_ELEMENTS", 3 * 128)  # 3 rows at a time, ragged last block
    chunked = quantize(w, 4, 64)
    for a, b in zip(whole, chunked):
        assert torch.equal(a.view(torch.int32) if a.dtype == torch.uint32 else a,
                           b.view(torch.int32) if b.dtype == torch.uint32 else b)


def test_constant_groups_stay_finite():
    w = torch.full((2, 64), 0.25, dtype=torch.float16)
    weight, scales, biases = quantize(w, 4, 64)
    deq = dequantize(weight, scales, biases, 4, 64)
    assert torch.isfinite(deq).all() and torch.allclose(deq, w.float())


def test_quantize_refuses_bad_shapes():
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 96), 4, 64)
    with pytest.raises(ValueError):
        quantize(torch.randn(4, 64), 3, 64)
    assert not can_quantize((4, 96), 64) and not can_quantize((64,), 64) and can_quantize((4, 128), 64)


def test_quant_spec_json():
    assert QuantSpec(4, 64).to_json() == {"bits": 4, "group_size": 64}
    assert QuantSpec.from_json(None) == QuantSpec() and not QuantSpec().quantized
    assert QuantSpec.from_json({"bits": 8, "group_size": 32}) == QuantSpec(8, 32)


def test_mlx_config_defaults_overrides_and_float_modules():
    q = MlxQuantization.from_config({"quantization": {"group_size": 64, "bits": 4,
                                                      "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                                                      "model.layers.0.self_attn.q_proj": False}})
    assert q.spec_for("model.layers.1.self_attn.q_proj") == QuantSpec(4, 64)
    assert q.spec_for("model.layers.0.mlp.gate") == QuantSpec(8, 64)
    assert q.spec_for("model.layers.0.self_attn.q_proj") == QuantSpec()
    assert MlxQuantization.from_config({"quantization_config": {"group_size": 32, "bits": 8}}) == MlxQuantization(8, 32)
    assert MlxQuantization.from_config({"model_type": "qwen3_moe"}) is None


@pytest.mark.parametrize("section", [{"quant_method": "fp8", "weight_block_size": [128, 128]},
                                     {"bits": 4, "group_size": 32, "mode": "mxfp4"}, {"bits": 4}])
def test_mlx_config_refuses_other_schemes(section):
    with pytest.raises(MoestreamError, match="config.json"):
        MlxQuantization.from_config({"quantization_config": section})


def test_mlx_input_size_checks_scales_against_bits():
    assert mlx_input_size("w", (8, 32), (8, 4), QuantSpec(4, 64)) == 256
    with pytest.raises(MoestreamError, match="w: packed shape"):
        mlx_input_size("w", (8, 32), (8, 4), QuantSpec(8, 64))
    with pytest.raises(MoestreamError, match="3-bit"):
        mlx_input_size("w", (8, 24), (8, 4), QuantSpec(3, 64))
