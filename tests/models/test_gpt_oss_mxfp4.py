"""gpt-oss's MXFP4 experts as the Hub stores them (`*_blocks` / `*_scales`, quant_method mxfp4):
dequantized exactly (the e2m1 code's value times 2^(scale - 127)), then re-quantized to a --quant
given explicitly (without it, convert keeps MXFP4 records: test_mxfp4_records).
The MXFP4 checkpoint is written here from the tiny float checkpoint."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from moestream.convert.main import convert
from moestream.convert.source import CheckpointSource
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from tests.models.test_parity import check_against, load_reference
from tests.tiny import load_all

STACKS = ("gate_up_proj", "down_proj")


def e2m1_values() -> torch.Tensor:
    """The 16 e2m1 values from the format: sign bit, 2 exponent bits (bias 1), 1 mantissa bit;
    exponent 0 is subnormal (mantissa · 0.5)."""
    out = []
    for code in range(16):
        sign, exp, mant = -1.0 if code & 8 else 1.0, (code >> 1) & 3, code & 1
        out.append(sign * (mant * 0.5 if exp == 0 else (1 + mant / 2) * 2.0 ** (exp - 1)))
    return torch.tensor(out)


def to_mxfp4(stack: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A stack [E, In, Out] (x @ W) -> blocks uint8 [E, Out, In/32, 16], scales uint8 [E, Out, In/32]:
    per 32 inputs a power of two that brings the largest within e2m1's 6, codes to the nearest value."""
    w = stack.float().transpose(1, 2)  # [E, Out, In]
    E, O, In = w.shape
    groups = w.reshape(E, O, In // 32, 32)
    amax = groups.abs().amax(-1).clamp(min=2.0 ** -100)
    exp = torch.ceil(torch.log2(amax / 6.0))  # [E, O, G]
    scaled = groups / torch.exp2(exp)[..., None]
    values = e2m1_values()
    codes = (scaled[..., None] - values).abs().argmin(-1).to(torch.uint8)  # [E, O, G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exp + 127).to(torch.uint8)


def write_mxfp4_checkpoint(folder: Path, out: Path) -> Path:
    shutil.copytree(folder, out, ignore=shutil.ignore_patterns("*.safetensors"))
    tensors = {}
    for name, t in load_all(folder).items():
        if name.endswith(STACKS):
            tensors[name + "_blocks"], tensors[name + "_scales"] = to_mxfp4(t)
        else:
            tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                     "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def transformers_dequantized(folder: Path) -> dict[str, torch.Tensor]:
    tensors = load_all(folder)
    out = {n: t for n, t in tensors.items() if not n.endswith(("_blocks", "_scales"))}
    for name in [n for n in tensors if n.endswith("_blocks")]:
        stack = name[: -len("_blocks")]
        out[stack] = convert_moe_packed_tensors(tensors[name], tensors[stack + "_scales"], dtype=torch.bfloat16)
    return out


@pytest.fixture
def mxfp4_checkpoint(tiny_checkpoint, tmp_path):
    return write_mxfp4_checkpoint(tiny_checkpoint("gpt_oss"), tmp_path / "mxfp4")


def test_blocks_dequantize_exactly_as_the_format_and_transformers_say(mxfp4_checkpoint):
    raw, expected = load_all(mxfp4_checkpoint), transformers_dequantized(mxfp4_checkpoint)
    source = CheckpointSource(mxfp4_checkpoint)
    try:
        assert not [n for n in source.names() if n.endswith(("_blocks", "_scales"))]
        for layer in (0, 1):
            for stack in STACKS:
                name = f"model.layers.{layer}.mlp.experts.{stack}"
                blocks, scales = raw[name + "_blocks"], raw[name + "_scales"]
                got = source.get(name)
                assert got.dtype == torch.bfloat16 and torch.equal(got, expected[name])
                assert torch.equal(got.float(), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
                # from the format itself: code c of input i, output o, in block g = i // 32
                E, O, G, _ = blocks.shape
                codes = torch.stack((blocks & 15, blocks >> 4), -1).reshape(E, O, G * 32).long()
                spec = e2m1_values()[codes] * torch.exp2(scales.float() - 127).repeat_interleave(32, -1)
                assert torch.equal(got.float(), spec.transpose(1, 2))
                assert torch.equal(source.get_rows(name, 3, 2), got[3:5])
                assert source.info(name).shape == tuple(got.shape) and source.nbytes(name) == 2 * got.numel()
                assert got.abs().max() > 0 and (got != 0).float().mean() > 0.5
    finally:
        source.close()


@pytest.mark.parametrize("quant", ["none", "q4"])
def test_mxfp4_converts_like_its_dequantized_checkpoint_and_matches_transformers(quant, mxfp4_checkpoint, tmp_path):
    dequantized = tmp_path / "dequantized"
    shutil.copytree(mxfp4_checkpoint, dequantized, ignore=shutil.ignore_patterns("*.safetensors"))
    save_file(transformers_dequantized(mxfp4_checkpoint), str(dequantized / "model.safetensors"))
    config = json.loads((dequantized / "config.json").read_text())
    del config["quantization_config"]
    (dequantized / "config.json").write_text(json.dumps(config))

    a = convert(mxfp4_checkpoint, tmp_path / "from-mxfp4", quant=quant, progress=False)
    b = convert(dequantized, tmp_path / "from-float", quant=quant, progress=False)
    assert PackedModel(a).manifest.quantization["dequantized"] == {"quant_method": "mxfp4"}
    for name in ["dense.safetensors", "experts-000.bin", "experts-001.bin"]:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    engine = Engine.load(a, options=EngineOptions(device="cpu"))
    if quant == "none":  # the float records are transformers' dequantization: the same logits and tokens
        check_against(engine, load_reference(dequantized))
    else:
        gen = list(engine.generate(engine.tokenizer.encode("def fibonacci(n):"), max_new_tokens=8, stop_at_eos=False))
        assert len(gen) == 8


def test_blocks_without_scales_or_config_are_refused(mxfp4_checkpoint, tmp_path):
    tensors = load_all(mxfp4_checkpoint)
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, str(mxfp4_checkpoint / "model.safetensors"))
    with pytest.raises(MoestreamError, match=r"^model\.layers\.1\.mlp\.experts\.down_proj_blocks: MXFP4 blocks without "
                                             r"their model\.layers\.1\.mlp\.experts\.down_proj_scales$"):
        convert(mxfp4_checkpoint, tmp_path / "out", progress=False)
    config = json.loads((mxfp4_checkpoint / "config.json").read_text())
    del config["quantization_config"]
    (mxfp4_checkpoint / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestreamError, match=r"MXFP4 blocks, but config.json has no quantization_config with "
                                             "quant_method mxfp4"):
        convert(mxfp4_checkpoint, tmp_path / "out", progress=False)
