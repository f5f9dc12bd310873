"""Importing GPTQ and AWQ checkpoints. A tiny model's matrices are quantized here in each format
and packed as the Hub stores them; the reference values are s·(q − z) from the codes before
packing, so the importer's unpacking is checked against an independent packer (itself checked
against the documented bit layout)."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from moestream.quant.gptq import GroupwiseConfig, GroupwiseWeight
from tiny import load_all

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ's GEMM packing: word element j holds column AWQ_ORDER[j]
GROUP = 32
PROMPT = [5, 17, 42, 99, 3, 250, 11]


def pack_words(codes: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int [R, C] -> int32 [R, C·b/32], element j of a word at bits j·b (wrapping to int32)."""
    per = 32 // bits
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, per)
    words = sum((c[..., j] & ((1 << bits) - 1)) << (j * bits) for j in range(per))
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def awq_shuffle(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1, 8)[..., AWQ_ORDER].reshape(t.shape[0], -1)


def test_packers_follow_the_documented_layouts():
    ramp = torch.arange(8).reshape(1, 8)
    assert pack_words(ramp).item() == 0x76543210  # GPTQ: element j at bits 4j
    assert (pack_words(awq_shuffle(ramp)).item() & 0xFFFFFFFF) == 0x75316420  # AWQ: 0 2 4 6 1 3 5 7


def quantize_module(w: torch.Tensor, *, act_order: bool, seed: int):
    """w [O, I] -> codes [I, O], zeros [G, O], fp16 scales [G, O], g_idx [I] (asymmetric 4-bit)."""
    out_features, in_features = w.shape
    groups = in_features // GROUP
    perm = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed)) if act_order \
        else torch.arange(in_features)
    g_idx = torch.empty(in_features, dtype=torch.int64)
    g_idx[perm] = torch.arange(in_features) // GROUP  # the quantizer walks the inputs in perm's order
    wt = w.T.to(torch.float32)  # [I, O]
    scales = torch.empty(groups, out_features, dtype=torch.float16)
    zeros = torch.empty(groups, out_features, dtype=torch.int64)
    for g in range(groups):
        cols = wt[g_idx == g]
        lo, hi = cols.amin(0).clamp(max=0), cols.amax(0).clamp(min=0)
        scales[g] = ((hi - lo) / 15).clamp_min(1e-4).to(torch.float16)
        zeros[g] = torch.round(-lo / scales[g].float()).clamp(1, 15)  # 1..15: v1 cannot store 0
    codes = torch.round(wt / scales.float()[g_idx]) + zeros[g_idx]
    return codes.clamp(0, 15).to(torch.int64), zeros, scales, g_idx


def reference(codes, zeros, scales, g_idx) -> torch.Tensor:
    """[O, I] float32 s·(q − z), from the codes before packing."""
    return (scales.float()[g_idx] * (codes - zeros[g_idx]).float()).T.contiguous()


QUANTIZED = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "gate_proj", "up_proj",
             "down_proj")


def build(folder: Path, out: Path, method: str, *, act_order: bool = False, fmt: str = "gptq"):
    """(GPTQ/AWQ checkpoint, float checkpoint of its dequantized values, {module: reference})."""
    tensors, saved, floats, refs = load_all(folder), {}, {}, {}
    for i, (name, w) in enumerate(sorted(tensors.items())):
        module = name[: -len(".weight")]
        if not (name.endswith(".weight") and module.endswith(QUANTIZED)):
            saved[name] = floats[name] = w
            continue
        codes, zeros, scales, g_idx = quantize_module(w, act_order=act_order, seed=i)
        refs[module] = floats[name] = reference(codes, zeros, scales, g_idx)
        if method == "gptq":
            stored_zeros = zeros - 1 if fmt == "gptq" else zeros
            saved.update({module + ".qweight": pack_words(codes.T).T.contiguous(),  # packed along the input
                          module + ".qzeros": pack_words(stored_zeros), module + ".scales": scales,
                          module + ".g_idx": g_idx.to(torch.int32)})
        else:
            saved.update({module + ".qweight": pack_words(awq_shuffle(codes)), module + ".qzeros": pack_words(awq_shuffle(zeros)),
                          module + ".scales": scales})
    config = json.loads((folder / "config.json").read_text())
    quant = {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": act_order, "sym": False,
             "checkpoint_format": fmt} if method == "gptq" else \
        {"quant_method": "awq", "bits": 4, "group_size": GROUP, "zero_point": True, "version": "gemm"}
    sources = {}
    for kind, weights, cfg in (("q", saved, {**config, "quantization_config": quant}), ("f", floats, config)):
        dst = out / f"{method}-{kind}"
        dst.mkdir(parents=True)
        for p in folder.iterdir():
            if not p.name.endswith(".safetensors") and p.name != "config.json":
                shutil.copy(p, dst / p.name)
        (dst / "config.json").write_text(json.dumps(cfg))
        names = sorted(weights)
        save_file({k: weights[k].contiguous() for k in names[::2]}, str(dst / "model-00001-of-00002.safetensors"))
        save_file({k: weights[k].contiguous() for k in names[1::2]}, str(dst / "model-00002-of-00002.safetensors"))
        sources[kind] = dst
    return sources["q"], sources["f"], refs


def greedy(model_dir, n=12) -> list[int]:
    engine = Engine.load(model_dir, options=EngineOptions(device="cpu", threads=1), prefetch=False)
    try:
        gen = engine.generate(PROMPT, max_new_tokens=n, sampling=SamplingParams())
        return [event.token_id for event in gen]
    finally:
        engine.close()


def check_weights(packed: PackedModel, refs: dict) -> int:
    checked = 0
    for module, want in refs.items():
        if ".experts." in module:
            prefix, expert, proj = module.rsplit(".", 2)[0].rsplit(".experts.", 1)[0], *module.rsplit(".", 2)[1:]
            layer = int(prefix.split(".layers.")[1].split(".")[0])
            got = packed.dequantized_expert(layer, int(expert), torch.float32)[proj]
        else:
            got = packed.dense(module + ".weight").to(torch.float32)
        assert torch.equal(got, want), module
        checked += 1
    return checked


@pytest.fixture(scope="module")
def source(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe")


@pytest.mark.parametrize("method,fmt", [("gptq", "gptq"), ("gptq", "gptq_v2"), ("awq", None)])
def test_codes_kept_bit_exactly_and_generation_matches_the_float_import(source, tmp_path, method, fmt):
    quantized, floats, refs = build(source, tmp_path, method, fmt=fmt or "gptq")
    out = convert(quantized, tmp_path / "m", progress=False)  # q4 and group 32: the source's codes fit as they are
    packed = PackedModel(out)
    q = packed.manifest.quantization
    assert (q["imported"], q["default_bits"], q["group_size"]) == (method, 4, GROUP)
    entry = packed.manifest.expert_layers[0]
    assert entry.quant["gate_proj"] == {"bits": 4, "group_size": GROUP}
    assert q["tensors"]["model.layers.0.self_attn.q_proj.weight"] == {"bits": 4, "group_size": GROUP}
    assert check_weights(packed, refs) == len(refs) > 40
    reference_model = convert(floats, tmp_path / "f", quant="none", progress=False)
    assert greedy(out) == greedy(reference_model)


def test_act_order_is_dequantized_exactly_then_quantized(source, tmp_path):
    quantized, floats, refs = build(source, tmp_path, "gptq", act_order=True)
    assert any(not torch.equal(t, torch.arange(len(t)) // GROUP)
               for n, t in load_all(quantized).items() if n.endswith("g_idx"))
    out = convert(quantized, tmp_path / "none", quant="none", progress=False)
    packed = PackedModel(out)
    assert packed.manifest.quantization["dequantized_from"] == "gptq"
    assert check_weights(packed, refs) == len(refs)
    assert greedy(out) == greedy(convert(floats, tmp_path / "f", quant="none", progress=False))
    # at q4 the dequantized values are quantized as a float checkpoint's are: the same bytes
    a = PackedModel(convert(quantized, tmp_path / "q4", progress=False))
    b = PackedModel(convert(floats, tmp_path / "f4", progress=False))
    assert "imported" not in a.manifest.quantization
    for entry in a.manifest.expert_layers:
        for expert in range(entry.num_experts):
            assert a.read_record(entry.layer, expert) == b.read_record(entry.layer, expert)


def test_other_bits_dequantize(source, tmp_path):
    """Asked for q8 (or group sizes that differ), the 4-bit codes are dequantized, then quantized to 8 bits."""
    quantized, floats, refs = build(source, tmp_path, "awq")
    a = PackedModel(convert(quantized, tmp_path / "q8", quant="q8", progress=False))
    b = PackedModel(convert(floats, tmp_path / "f8", quant="q8", progress=False))
    assert a.manifest.quantization["default_bits"] == 8
    assert a.read_record(0, 3) == b.read_record(0, 3)


def test_unpack_matches_the_reference_for_8_bit_gptq():
    torch.manual_seed(0)
    codes = torch.randint(0, 256, (64, 16))
    zeros = torch.randint(1, 256, (2, 16))
    scales = torch.rand(2, 16).to(torch.float16)
    config = GroupwiseConfig("gptq", 8, GROUP, zeros_minus_one=True)
    w = GroupwiseWeight.unpack(config, pack_words(codes.T, 8).T.contiguous(), pack_words(zeros - 1, 8), scales)
    g_idx = torch.arange(64) // GROUP
    assert torch.equal(w.dequantize(), reference(codes, zeros, scales, g_idx))
    words, s, b = w.to_affine(8)
    from moestream.quant.affine import dequantize
    assert torch.equal(dequantize(words, s, b, 8, GROUP), reference(codes, zeros, scales, g_idx))


@pytest.mark.parametrize("change,message", [
    ({"version": "gemv"}, "AWQ version 'gemv' is not supported"),
    ({"bits": 3, "quant_method": "gptq"}, "3-bit GPTQ is not supported"),
    ({"quant_method": "gptq", "checkpoint_format": "marlin"}, "GPTQ checkpoint_format 'marlin' is not supported"),
])
def test_unsupported_settings_are_one_line(source, tmp_path, change, message):
    quantized, _, _ = build(source, tmp_path, "awq")
    config = json.loads((quantized / "config.json").read_text())
    config["quantization_config"].update(change)
    (quantized / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestreamError, match=message):
        convert(quantized, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_a_missing_part_is_named(source, tmp_path):
    quantized, _, _ = build(source, tmp_path, "gptq")
    shard = quantized / "model-00001-of-00002.safetensors"
    tensors = load_all(quantized)
    first = sorted(tensors)[::2]
    victim = next(n for n in first if n.endswith(".qzeros"))
    save_file({k: tensors[k].contiguous() for k in first if k != victim}, str(shard))
    with pytest.raises(MoestreamError, match=victim.replace(".", r"\.") + " is missing"):
        convert(quantized, tmp_path / "m", progress=False)
