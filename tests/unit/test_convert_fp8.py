"""Importing block-scaled FP8 checkpoints (float8 e4m3 weights beside `weight_scale_inv` grids, as
DeepSeek-V3 and the Qwen3 FP8 releases store them): dequantized as transformers dequantizes them,
then quantized to our formats. The FP8 checkpoint is written here from a tiny checkpoint."""
import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight

from moestream.convert.main import convert
from moestream.convert.source import CheckpointSource
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from tiny import load_all

E4M3_MAX = 448.0
# the matrices FP8 releases store in float8: every projection in the layers (not embeddings, head, router)
QUANTIZED = re.compile(r"^model\.layers\.\d+\..*_proj(_with_mqa)?\.weight$")


def to_fp8_blocks(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [R, C] -> (e4m3 [R, C], scale_inv [ceil(R/bm), ceil(C/bn)]): each block scaled so its
    largest magnitude is e4m3's largest, edge blocks partial."""
    bm, bn = block
    R, C = w.shape
    gr, gc = -(-R // bm), -(-C // bn)
    padded = torch.zeros(gr * bm, gc * bn)
    padded[:R, :C] = w.float()
    tiles = padded.view(gr, bm, gc, bn)
    amax = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12)  # [gr, gc]
    scale_inv = amax / E4M3_MAX
    q = (tiles / scale_inv[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).view(gr * bm, gc * bn)[:R, :C]
    return q.to(torch.float8_e4m3fn), scale_inv


def write_fp8_checkpoint(folder: Path, out: Path, block: tuple[int, int]) -> Path:
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for name, t in load_all(folder).items():
        if QUANTIZED.match(name):
            tensors[name], tensors[name + "_scale_inv"] = to_fp8_blocks(t, block)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (out / "config.json").write_text(json.dumps(config))
    return out


def transformers_dequantized(fp8_folder: Path, block) -> dict[str, torch.Tensor]:
    """Every tensor, the FP8 ones through transformers' dequantization (float32)."""
    tensors = load_all(fp8_folder)
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else _dequantize_fp8_weight(t, scale, list(block), torch.float32)
    return out


def write_dequantized_checkpoint(fp8_folder: Path, out: Path, block) -> Path:
    shutil.copytree(fp8_folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(transformers_dequantized(fp8_folder, block), str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
def test_fp8_weights_dequantize_as_transformers_does(block, tiny_checkpoint, tmp_path):
    """kv_a_proj_with_mqa's 80 rows end in a partial block of 32; at 128 every matrix is one partial block."""
    fp8 = write_fp8_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path / "fp8", block)
    raw, expected = load_all(fp8), transformers_dequantized(fp8, block)
    source = CheckpointSource(fp8)
    try:
        scaled = [n for n in raw if n + "_scale_inv" in raw]
        assert len(scaled) > 20 and not [n for n in source.names() if n.endswith("_scale_inv")]
        for name in scaled:
            got = source.get(name)
            assert got.dtype == torch.float32 and torch.equal(got, expected[name]), name
            assert source.info(name).dtype == "F32" and source.nbytes(name) == 4 * got.numel()
            rows = got.shape[0]
            assert torch.equal(source.get_rows(name, rows // 3, rows // 2), got[rows // 3: rows // 3 + rows // 2])
            if rows % block[0] == 0 and got.shape[1] % block[1] == 0:  # transformers' load-time path needs whole blocks
                plain = Fp8Dequantize(None)._dequantize_one(raw[name], raw[name + "_scale_inv"], torch.float32)
                assert torch.equal(got, plain), name
        assert torch.equal(source.get("model.embed_tokens.weight"), raw["model.embed_tokens.weight"])
    finally:
        source.close()


def test_fp8_converts_like_its_dequantized_float_checkpoint(tiny_checkpoint, tmp_path):
    block = (32, 32)
    fp8 = write_fp8_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path / "fp8", block)
    dequantized = write_dequantized_checkpoint(fp8, tmp_path / "float", block)
    expected = load_all(dequantized)
    for quant in ("none", "q4"):
        a = convert(fp8, tmp_path / f"from-fp8-{quant}", quant=quant, progress=False)
        b = convert(dequantized, tmp_path / f"from-float-{quant}", quant=quant, progress=False)
        pa = PackedModel(a)
        assert pa.manifest.quantization["dequantized"] == {"quant_method": "fp8", "weight_block_size": [32, 32]}
        assert load_all_dense(a) == load_all_dense(b)
        for entry in pa.manifest.expert_layers:
            assert (a / entry.file).read_bytes() == (b / entry.file).read_bytes()
        if quant == "none":  # the stored float weights are transformers' dequantization
            name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
            assert torch.equal(pa.dense(name, torch.float32), expected[name])
            assert torch.equal(pa.dequantized_expert(1, 3)["down_proj"], expected["model.layers.1.mlp.experts.3.down_proj.weight"])
        runs = []
        for packed in (a, b):
            engine = Engine.load(packed, options=EngineOptions(device="cpu"))
            gen = engine.generate(engine.tokenizer.encode("def fibonacci(n):"), max_new_tokens=12, logprobs=1,
                                  stop_at_eos=False)
            runs.append([(e.token_id, e.logprob) for e in gen])
            engine.close()
        assert runs[0] == runs[1] and len(runs[0]) == 12


def load_all_dense(packed: Path) -> dict[str, bytes]:
    from safetensors import safe_open

    with safe_open(str(packed / "dense.safetensors"), framework="pt") as f:
        return {k: f.get_tensor(k).view(torch.uint8).numpy().tobytes() for k in f.keys()}


def rewrite(folder: Path, *, drop: str | None = None, reshape: str | None = None, config: dict | None = None) -> Path:
    tensors = load_all(folder)
    if drop:
        del tensors[drop]
    if reshape:
        tensors[reshape] = tensors[reshape][:1].contiguous()
    save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


SCALE = "model.layers.0.self_attn.o_proj.weight_scale_inv"


@pytest.mark.parametrize("case, message", [
    ("no scale", "model.layers.0.self_attn.o_proj.weight: an FP8 weight without its model.layers.0.self_attn.o_proj.weight_scale_inv"),
    ("grid", f"{SCALE}: scale grid [1, 4], but a [64, 128] weight in [32, 32] blocks has [2, 4]"),
    ("no config", "model.layers.0.mlp.down_proj.weight_scale_inv: an FP8 scale, but config.json has no quantization_config with quant_method fp8"),
    ("static", "config.json: quantization_config.activation_scheme 'static' is not supported"),
    ("e5m2", "config.json: quantization_config.fmt 'e5m2' is not supported (only e4m3)"),
    ("block", "config.json: quantization_config.weight_block_size must be two positive integers, not None"),
])
def test_bad_fp8_checkpoints_are_refused_in_one_line(case, message, tiny_checkpoint, tmp_path):
    folder = write_fp8_checkpoint(tiny_checkpoint("deepseek_v3"), tmp_path / "fp8", (32, 32))
    config = json.loads((folder / "config.json").read_text())
    q = config["quantization_config"]
    if case == "no scale":
        rewrite(folder, drop=SCALE)
    elif case == "grid":
        rewrite(folder, reshape=SCALE)
    elif case == "no config":
        del config["quantization_config"]
    elif case == "static":
        q["activation_scheme"] = "static"
    elif case == "e5m2":
        q["fmt"] = "e5m2"
    elif case == "block":
        del q["weight_block_size"]
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestreamError) as err:
        convert(folder, tmp_path / "out", progress=False)
    assert message in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()
