"""Importing mlx-community style checkpoints (switch_mlp stacks, packed uint32 words, per-module
overrides) without re-quantizing. The MLX checkpoint is built here from a tiny checkpoint."""
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.layout import ExpertNames
from moestream.convert.main import convert
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel
from moestream.models.registry import family_module
from moestream.quant.affine import quantize
from tiny import load_all

GROUP = 64
PROJS = ("gate_proj", "up_proj", "down_proj")




def quantize_stack(w: torch.Tensor, bits: int, group_size: int):
    parts = [quantize(m, bits, group_size) for m in w]
    return tuple(torch.stack(p) for p in zip(*parts))


def build_mlx_checkpoint(folder: Path, out: Path, overrides: dict) -> Path:
    """Experts stacked into switch_mlp [E, O, I] and quantized in MLX layout; dense matrices too."""
    out.mkdir()
    for p in folder.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy(p, out / p.name)
    tensors = load_all(folder)
    modules: dict[str, torch.Tensor] = {}
    stacks: dict[tuple[str, str], dict[int, torch.Tensor]] = {}
    family = json.loads((folder / "config.json").read_text())["model_type"]
    names = ExpertNames(family_module(family))
    for name, t in tensors.items():
        if m := names.per_expert.match(name):
            stacks.setdefault((m["prefix"], names.ours[m["proj"]]), {})[int(m["expert"])] = t
        elif name.endswith(".weight") and t.dim() == 2 and t.shape[1] % GROUP == 0:
            modules[name[: -len(".weight")]] = t
        else:
            modules[name] = t  # norms and biases keep their names as they are
    for (prefix, proj), by_expert in stacks.items():
        modules[f"{prefix}.switch_mlp.{proj}"] = torch.stack([by_expert[e] for e in sorted(by_expert)])
    saved = {}
    for module, w in modules.items():
        if w.dim() == 1 or module.endswith((".weight", ".bias")):
            saved[module] = w
            continue
        override = overrides.get(module)
        if override is False:
            saved[module + ".weight"] = w
            continue
        bits = override["bits"] if override else 4
        q = quantize_stack(w, bits, GROUP) if w.dim() == 3 else quantize(w, bits, GROUP)
        saved.update({module + ".weight": q[0], module + ".scales": q[1], module + ".biases": q[2]})
    half = sorted(saved)[: len(saved) // 2]
    save_file({k: saved[k] for k in half}, str(out / "model-00001-of-00002.safetensors"))
    save_file({k: saved[k] for k in saved if k not in half}, str(out / "model-00002-of-00002.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    config["quantization"] = {"group_size": GROUP, "bits": 4, **overrides}
    config["quantization_config"] = dict(config["quantization"])
    (out / "config.json").write_text(json.dumps(config))
    return out


def reference_dequant(words: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int) -> torch.Tensor:
    """q * scale + bias from the source's own codes: element j of a word sits at bits j*b."""
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    per_word = 32 // bits
    codes = torch.stack([(w >> (bits * j)) & ((1 << bits) - 1) for j in range(per_word)], dim=-1)
    codes = codes.reshape(w.shape[0], -1, GROUP).to(torch.float32)
    return (codes * scales.float()[..., None] + biases.float()[..., None]).reshape(w.shape[0], -1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype.itemsize == b.dtype.itemsize and a.shape == b.shape and \
        torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


FAMILY_CASES = {
    "qwen3_moe": {"model.layers.0.mlp.switch_mlp.down_proj": {"group_size": 64, "bits": 8},
                  "model.layers.0.mlp.gate": {"group_size": 64, "bits": 8},
                  "model.layers.2.self_attn.o_proj": False},
    "mixtral": {"model.layers.1.block_sparse_moe.switch_mlp.gate_proj": {"group_size": 64, "bits": 8},
                "model.layers.0.self_attn.q_proj": False},
}


@pytest.fixture(scope="module", params=sorted(FAMILY_CASES))
def mlx_case(request, tiny_checkpoint, tmp_path_factory):
    family = request.param
    folder = tiny_checkpoint(family, dtype="bfloat16")
    mlx = build_mlx_checkpoint(folder, tmp_path_factory.mktemp("mlx") / "src", FAMILY_CASES[family])
    out = convert(mlx, tmp_path_factory.mktemp("mlx-out") / "m", progress=False)
    return family, mlx, PackedModel(out)


def test_experts_copied_and_dequantized_bit_exactly(mlx_case):
    family, mlx, packed = mlx_case
    src = load_all(mlx)
    overrides = FAMILY_CASES[family]
    checked = 0
    for entry in packed.manifest.expert_layers:
        moe = "block_sparse_moe" if family == "mixtral" else "mlp"
        prefix = f"model.layers.{entry.layer}.{moe}.switch_mlp"
        for proj in PROJS:
            bits = (overrides.get(f"{prefix}.{proj}") or {"bits": 4})["bits"]
            assert entry.quant[proj] == {"bits": bits, "group_size": GROUP}
            for expert in range(entry.num_experts):
                stored = packed.expert_tensors(entry.layer, expert)
                words, scales, biases = (src[f"{prefix}.{proj}.{k}"][expert] for k in ("weight", "scales", "biases"))
                assert same_bits(stored[f"{proj}.weight"], words)
                assert same_bits(stored[f"{proj}.scales"], scales) and same_bits(stored[f"{proj}.biases"], biases)
                deq = packed.dequantized_expert(entry.layer, expert, torch.float32)[proj]
                assert torch.equal(deq, reference_dequant(words, scales, biases, bits))
                checked += 1
    assert checked > 0


def test_dense_tensors_copied_as_they_are(mlx_case):
    family, mlx, packed = mlx_case
    src = load_all(mlx)
    specs = packed.manifest.quantization["tensors"]
    assert packed.manifest.quantization["imported"] == "mlx"
    dense_src = {n: t for n, t in src.items() if ".switch_mlp." not in n}
    assert packed.dense_names == set(dense_src)
    for name, t in dense_src.items():
        assert same_bits(packed.raw_dense(name), t), name
    for module, override in FAMILY_CASES[family].items():
        if "switch_mlp" in module:
            continue
        if override is False:
            assert specs[module + ".weight"] is None
            assert torch.equal(packed.dense(module + ".weight"), src[module + ".weight"])
        else:
            assert specs[module + ".weight"] == {"bits": override["bits"], "group_size": GROUP}
    embed = "model.embed_tokens"
    assert specs[embed + ".weight"] == {"bits": 4, "group_size": GROUP}
    assert torch.equal(packed.dense(embed + ".weight"),
                       reference_dequant(src[embed + ".weight"], src[embed + ".scales"], src[embed + ".biases"], 4))
    assert specs["model.norm.weight"] is None


def test_mlx_bits_that_disagree_with_the_tensors(tiny_checkpoint, tmp_path):
    mlx = build_mlx_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path / "src",
                               {"model.layers.0.mlp.switch_mlp.down_proj": {"group_size": 64, "bits": 8}})
    config = json.loads((mlx / "config.json").read_text())
    for key in ("quantization", "quantization_config"):
        del config[key]["model.layers.0.mlp.switch_mlp.down_proj"]  # now claims 4 bits for 8-bit words
    (mlx / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestreamError, match=r"model\.layers\.0\.mlp\.switch_mlp\.down_proj\.weight: packed shape"):
        convert(mlx, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_other_quantization_methods_are_refused(tiny_checkpoint, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("olmoe"), src)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "bitsandbytes", "bits": 4}
    (src / "config.json").write_text(json.dumps(config))
    with pytest.raises(MoestreamError, match="quant_method .bitsandbytes. is not supported"):
        convert(src, tmp_path / "m", progress=False)
