"""gpt-oss GGUFs (llama.cpp's arch `gpt-oss`): the tiny gpt_oss checkpoint written as llama.cpp lays
it out (split or fused gate/up stacks with biases, sinks, router bias, post-attention norm, YaRN,
sliding layers, the tokenizer in the metadata), its expert matrices in MXFP4, imports as the
safetensors checkpoint holding gguf's MXFP4 dequantization of them: the same records and tensors,
the same tokens, and transformers' logits on that checkpoint."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from tests.models.test_mxfp4_records import expert_outputs
from tests.models.test_parity import check_against, load_reference
from tiny import load_all

gguf = pytest.importorskip("gguf")
from gguf_files import write_gpt_oss  # noqa: E402 (needs gguf)

T = gguf.GGMLQuantizationType
PROMPT = [5, 17, 42, 99, 3, 250, 7]


def hf_stacks(held: dict[str, np.ndarray], layer: int) -> dict[str, torch.Tensor]:
    """llama.cpp's stacks of one layer put back as transformers stores them (x @ W, gate and up
    rows interleaved)."""
    blk, p = f"blk.{layer}.", f"model.layers.{layer}.mlp.experts."
    out = {}
    for kind, suffix in (("weight", ""), ("bias", "_bias")):
        if blk + f"ffn_gate_up_exps.{kind}" in held:
            gate, up = np.split(held[blk + f"ffn_gate_up_exps.{kind}"], 2, axis=1)
        else:
            gate, up = held[blk + f"ffn_gate_exps.{kind}"], held[blk + f"ffn_up_exps.{kind}"]
        fused = np.empty((gate.shape[0], 2 * gate.shape[1], *gate.shape[2:]), np.float32)
        fused[:, 0::2], fused[:, 1::2] = gate, up
        down = held[blk + f"ffn_down_exps.{kind}"]
        out[p + "gate_up_proj" + suffix] = torch.from_numpy(fused.transpose(0, 2, 1) if kind == "weight" else fused)
        out[p + "down_proj" + suffix] = torch.from_numpy(down.transpose(0, 2, 1) if kind == "weight" else down)
    return {k: v.contiguous() for k, v in out.items()}


def checkpoint_with(src, out, held):
    tensors = load_all(src)
    for layer in range(json.loads((src / "config.json").read_text())["num_hidden_layers"]):
        tensors.update(hf_stacks(held, layer))
    shutil.copytree(src, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(tensors, str(out / "model.safetensors"))
    return out


def tokens(model_dir) -> list[int]:
    engine = Engine.load(model_dir, options=EngineOptions(device="cpu", threads=1), prefetch=False)
    try:
        return [e.token_id for e in engine.generate(PROMPT, max_new_tokens=10, stop_at_eos=False)]
    finally:
        engine.close()


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_float_gguf_stacks_are_the_checkpoints_own(tiny_checkpoint, tmp_path, fuse_gate_up):
    """The test's own way back from llama.cpp's stacks to transformers' gives the original bits."""
    src = tiny_checkpoint("gpt_oss")
    held = write_gpt_oss(src, tmp_path / "f32.gguf", expert_type=T.F32, fuse_gate_up=fuse_gate_up)
    original = load_all(src)
    for layer in (0, 1):
        for name, t in hf_stacks(held, layer).items():
            assert torch.equal(t, original[name]), name


@pytest.mark.parametrize("fuse_gate_up,limit", [(False, 7.0), (True, 0.5)])
def test_mxfp4_gpt_oss_gguf_imports_as_its_dequantized_checkpoint(tiny_checkpoint, tmp_path, fuse_gate_up, limit):
    # 7.0: what llama.cpp's gpt-oss assumes (not written); 0.5 (clamps this model) written as swiglu_clamp_exp
    src = tiny_checkpoint("gpt_oss", swiglu_limit=limit)
    path = tmp_path / "tiny-mxfp4.gguf"
    held = write_gpt_oss(src, path, expert_type=T.MXFP4, fuse_gate_up=fuse_gate_up, swiglu_clamp=limit != 7.0)
    assert {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors if "_exps.weight" in t.name} == {T.MXFP4}

    out = convert(path, tmp_path / "gguf", quant="none", progress=False)
    dequantized = checkpoint_with(src, tmp_path / "dequantized", held)
    reference = convert(dequantized, tmp_path / "st", quant="none", progress=False)
    got, want = PackedModel(out), PackedModel(reference)

    config, source_config = got.manifest.config, json.loads((src / "config.json").read_text())
    assert config["model_type"] == "gpt_oss"
    for key in ("layer_types", "sliding_window", "swiglu_limit", "num_local_experts", "intermediate_size", "head_dim",
                "num_key_value_heads", "rms_norm_eps", "eos_token_id"):
        assert config[key] == pytest.approx(source_config[key]), key
    rope = {k: v for k, v in source_config["rope_parameters"].items() if k != "rope_theta"}
    assert config["rope_scaling"] == rope and config["rope_theta"] == source_config["rope_parameters"]["rope_theta"]

    # the records (matrices, biases, activation settings) and every resident tensor: the same bits
    for layer in (0, 1):
        assert got.expert_layer(layer).quant == want.expert_layer(layer).quant
        for expert in range(8):
            assert got.read_record(layer, expert) == want.read_record(layer, expert), (layer, expert)
    assert got.logical_dense_names() == want.logical_dense_names()
    for name in want.logical_dense_names():
        assert torch.equal(got.dense(name), want.dense(name)), name
    # MXFP4 changed the experts: the comparison can tell the two apart
    plain = PackedModel(convert(src, tmp_path / "orig", quant="none", progress=False))
    assert plain.read_record(0, 0) != got.read_record(0, 0)

    assert tokens(out) == tokens(reference)
    engine = Engine.load(out, options=EngineOptions(device="cpu"))
    try:
        check_against(engine, load_reference(dequantized))  # transformers on the dequantized checkpoint
    finally:
        engine.close()


def test_gpt_oss_gguf_without_its_down_stack_is_one_line(tiny_checkpoint, tmp_path):
    src = tiny_checkpoint("gpt_oss")
    write_gpt_oss(src, tmp_path / "full.gguf", expert_type=T.F32)
    reader = gguf.GGUFReader(str(tmp_path / "full.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "cut.gguf"), "gpt-oss")
    for key, field in reader.fields.items():
        if key.startswith(("gpt-oss.", "tokenizer.ggml.eos")):
            value = field.contents()
            w.add_key_value(key, value, field.types[0], sub_type=field.types[-1] if len(field.types) > 1 else None)
    for t in reader.tensors:
        if t.name != "blk.1.ffn_down_exps.bias":
            w.add_tensor(t.name, np.array(t.data))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(MoestreamError, match=r"GGUF tensor blk\.1\.ffn_down_exps\.bias is missing \(gpt-oss experts\)"):
        convert(tmp_path / "cut.gguf", tmp_path / "m", quant="none", progress=False)


def ggml_codes(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An MXFP4 tensor's bytes [.., rows, G*17] -> its codes [.., rows, G*32] in input order and scales
    [.., rows, G], as ggml reads them: per block the scale byte, then byte j holds inputs j (low) and j+16."""
    blocks = data.reshape(*data.shape[:-1], -1, 17)
    qs = blocks[..., 1:]
    return np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(*data.shape[:-1], -1), blocks[..., 0]


def record_codes(weight: torch.Tensor) -> np.ndarray:
    """A record's MXFP4 weight [out, in/2] -> codes [out, in]: byte k holds inputs 2k (low) and 2k+1."""
    w = weight.numpy()
    return np.stack([w & 15, w >> 4], axis=-1).reshape(w.shape[0], -1)


@pytest.mark.parametrize("fuse_gate_up", [False, True])
def test_mxfp4_gpt_oss_gguf_keeps_its_codes_and_scales(tiny_checkpoint, tmp_path, fuse_gate_up):
    """convert's default keeps the file's MXFP4 experts: the records hold its codes and scales (the
    nibbles re-paired), dequantize to gguf's own values bit for bit, and decode as --quant none does."""
    src = tiny_checkpoint("gpt_oss")
    path = tmp_path / "tiny-mxfp4.gguf"
    held = write_gpt_oss(src, path, expert_type=T.MXFP4, fuse_gate_up=fuse_gate_up)
    kept = PackedModel(convert(path, tmp_path / "kept", progress=False))
    assert kept.manifest.quantization["imported"] == "mxfp4"
    tensors = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for layer in (0, 1):
        assert {s["mode"] for s in kept.expert_layer(layer).quant.values()} == {"mxfp4"}
        blk = f"blk.{layer}."
        if fuse_gate_up:
            codes, scales = ggml_codes(np.array(tensors[blk + "ffn_gate_up_exps.weight"].data))
            half = codes.shape[1] // 2
            parts = {"gate_proj": (codes[:, :half], scales[:, :half]), "up_proj": (codes[:, half:], scales[:, half:])}
            gate, up = np.split(held[blk + "ffn_gate_up_exps.weight"], 2, axis=1)
        else:
            parts = {p: ggml_codes(np.array(tensors[blk + f"ffn_{p[:-5]}_exps.weight"].data)) for p in ("gate_proj", "up_proj")}
            gate, up = held[blk + "ffn_gate_exps.weight"], held[blk + "ffn_up_exps.weight"]
        parts["down_proj"] = ggml_codes(np.array(tensors[blk + "ffn_down_exps.weight"].data))
        values = {"gate_proj": gate, "up_proj": up, "down_proj": held[blk + "ffn_down_exps.weight"]}
        for expert in range(8):
            record = kept.expert_tensors(layer, expert)
            dequantized = kept.dequantized_expert(layer, expert)
            for proj, (codes, scales) in parts.items():
                assert np.array_equal(record_codes(record[f"{proj}.weight"]), codes[expert]), (layer, expert, proj)
                assert np.array_equal(record[f"{proj}.scales"].numpy(), scales[expert]), (layer, expert, proj)
                assert torch.equal(dequantized[proj], torch.from_numpy(values[proj][expert])), (layer, expert, proj)
    plain = convert(path, tmp_path / "none", quant="none", progress=False)  # the same values, in float
    x, ids = torch.randn(5, 64, generator=torch.Generator().manual_seed(1)), torch.tensor([[0, 3, 5, 7]] * 5)
    weights = torch.full((5, 4), 0.25)
    for layer in (0, 1):
        got = expert_outputs(kept.directory, layer, x, ids, weights, per_pair=True)
        assert torch.equal(got, expert_outputs(plain, layer, x, ids, weights, per_pair=True)) and got.abs().max() > 0
    assert len(tokens(kept.directory)) == 10
