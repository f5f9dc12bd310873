"""`moestream convert` on tiny checkpoints of every family: quantization bounds, bit-exact `none`,
per-expert / fused / sharded sources, and config.json spellings of transformers 4 and 5."""
import hashlib
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moestream.convert.layout import ExpertNames
from moestream.convert.main import convert
from moestream.format.manifest import MANIFEST_NAME
from moestream.format.reader import PackedModel
from moestream.models.registry import family_module
from tiny import load_all

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]




def expert_sources(tensors: dict, family: str) -> dict[tuple[int, int, str], torch.Tensor]:
    """(layer, expert, projection) -> tensor of the per-expert tensors, named as `family` names them."""
    names = ExpertNames(family_module(family))
    return {key: t for name, t in tensors.items() if (key := names.expert(name))}


def file_hashes(folder: Path, skip=()) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir())
            if p.is_file() and p.name not in skip}


def assert_within_half_step(w: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor, group_size: int, what: str):
    rows = w.shape[0]
    err = (w.float() - deq.float()).abs().reshape(rows, -1, group_size)
    bound = scales.float()[..., None] / 2 + 1e-6
    assert bool((err <= bound).all()), f"{what}: max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_experts_and_dense_within_half_a_step(family, tiny_checkpoint, tiny_packed_model):
    src = load_all(tiny_checkpoint(family))
    packed = PackedModel(tiny_packed_model(family, "q4"))
    experts = expert_sources(src, family)
    assert experts, "the tiny checkpoint has per-expert tensors"
    for (layer, expert, proj), w in experts.items():
        stored = packed.expert_tensors(layer, expert)
        deq = packed.dequantized_expert(layer, expert)[proj]
        assert packed.expert_layer(layer).quant[proj] == {"bits": 4, "group_size": 64}
        assert_within_half_step(w, deq, stored[f"{proj}.scales"], 64, f"layer {layer} expert {expert} {proj}")
    for name, w in src.items():
        if ExpertNames(family_module(family)).expert(name):
            continue
        spec = packed.tensor_spec(name)
        if spec.quantized:
            scales = packed.raw_dense(name[: -len(".weight")] + ".scales")
            assert_within_half_step(w, packed.dense(name), scales, spec.group_size, name)
        else:
            assert torch.equal(packed.dense(name), w), name
    tensors = packed.manifest.quantization["tensors"]
    routers = [n for n in tensors if n.endswith((".gate.weight", ".shared_expert_gate.weight"))]
    assert routers and all(tensors[n]["bits"] == 8 for n in routers)
    assert all(tensors[n] is None for n in tensors if n.endswith("norm.weight"))


@pytest.mark.parametrize("family", FAMILIES)
def test_none_round_trips_every_tensor_bit_exactly(family, tiny_checkpoint, tiny_packed_model):
    folder = tiny_checkpoint(family)
    src = load_all(folder)
    out = tiny_packed_model(family, "none")
    packed = PackedModel(out)
    experts = expert_sources(src, family)
    for (layer, expert, proj), w in experts.items():
        assert torch.equal(packed.expert_tensors(layer, expert)[f"{proj}.weight"], w)
        assert torch.equal(packed.dequantized_expert(layer, expert, w.dtype)[proj], w)
    dense = {n: t for n, t in src.items() if not ExpertNames(family_module(family)).expert(n)}
    assert set(packed.logical_dense_names()) == set(dense)
    for name, w in dense.items():
        got = packed.dense(name)
        assert got.dtype == w.dtype and torch.equal(got, w), name
    m = packed.manifest
    assert m.config == json.loads((folder / "config.json").read_text())  # verbatim
    assert m.source["path"] == str(folder.resolve())
    assert m.source["files"] == {"model.safetensors": hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest()}
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / name).read_bytes() == (folder / name).read_bytes()
        assert m.files[name]["sha256"] == hashlib.sha256((out / name).read_bytes()).hexdigest()
    assert not (out / "convert-state.json").exists()


def test_none_keeps_bf16_bit_exactly(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("mixtral", dtype="bfloat16")
    src = load_all(folder)
    packed = PackedModel(convert(folder, tmp_path / "m", quant="none", progress=False))
    for (layer, expert, proj), w in expert_sources(src, "mixtral").items():
        got = packed.expert_tensors(layer, expert)[f"{proj}.weight"]
        assert got.dtype == torch.bfloat16 and torch.equal(got, w)
    assert packed.dense("model.embed_tokens.weight").dtype == torch.bfloat16


def test_q8_group_32(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("olmoe")
    src = load_all(folder)
    packed = PackedModel(convert(folder, tmp_path / "m", quant="q8", group_size=32, progress=False))
    for (layer, expert, proj), w in list(expert_sources(src, "olmoe").items())[:6]:
        assert packed.expert_layer(layer).quant[proj] == {"bits": 8, "group_size": 32}
        stored = packed.expert_tensors(layer, expert)
        assert_within_half_step(w, packed.dequantized_expert(layer, expert)[proj], stored[f"{proj}.scales"], 32, proj)
    assert packed.manifest.quantization["default_bits"] == 8 and packed.manifest.quantization["group_size"] == 32


def test_matrix_with_odd_input_size_stays_float(tiny_checkpoint, tmp_path):
    folder = tiny_checkpoint("qwen3_moe", moe_intermediate_size=96)  # down_proj input 96 is not a multiple of 64
    src = expert_sources(load_all(folder), "qwen3_moe")
    packed = PackedModel(convert(folder, tmp_path / "m", quant="q4", progress=False))
    entry = packed.expert_layer(0)
    assert entry.quant["down_proj"] is None and entry.quant["gate_proj"] == {"bits": 4, "group_size": 64}
    assert torch.equal(packed.dequantized_expert(0, 5)["down_proj"], src[(0, 5, "down_proj")])


def fuse_checkpoint(folder: Path, out: Path) -> Path:
    """The same weights in the fused 3-D layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    out.mkdir()
    for p in folder.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy(p, out / p.name)
    tensors = load_all(folder)
    experts = expert_sources(tensors, "qwen3_moe")
    names = ExpertNames(family_module("qwen3_moe"))
    fused = {n: t for n, t in tensors.items() if not names.expert(n)}
    for layer in sorted({k[0] for k in experts}):
        count = len({k[1] for k in experts if k[0] == layer})
        prefix = f"model.layers.{layer}.mlp.experts"
        fused[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([experts[(layer, e, "gate_proj")], experts[(layer, e, "up_proj")]]) for e in range(count)])
        fused[f"{prefix}.down_proj"] = torch.stack([experts[(layer, e, "down_proj")] for e in range(count)])
    save_file(fused, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize("quant", ["none", "q4"])
def test_fused_layout_gives_the_same_records(quant, tiny_checkpoint, tiny_packed_model, tmp_path):
    folder = tiny_checkpoint("qwen3_moe")
    fused = fuse_checkpoint(folder, tmp_path / "fused")
    out = convert(fused, tmp_path / "m", quant=quant, progress=False)
    reference = tiny_packed_model("qwen3_moe", quant)
    ours, theirs = file_hashes(out, skip={MANIFEST_NAME}), file_hashes(reference, skip={MANIFEST_NAME})
    assert ours == theirs  # records and resident tensors byte-identical to the per-expert source
    assert PackedModel(out).manifest.expert_layers == PackedModel(reference).manifest.expert_layers


def shard_checkpoint(folder: Path, out: Path, *, index: bool) -> Path:
    out.mkdir()
    for p in folder.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy(p, out / p.name)
    tensors = load_all(folder)
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(out / file))
    if index:
        weight_map = {k: f for f, keys in shards.items() for k in keys}
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
        save_file({"stray": torch.zeros(1)}, str(out / "consolidated.safetensors"))  # not in the index: ignored
    return out


@pytest.mark.parametrize("index", [True, False])
def test_sharded_checkpoint(index, tiny_checkpoint, tiny_packed_model, tmp_path):
    folder = tiny_checkpoint("mixtral")
    sharded = shard_checkpoint(folder, tmp_path / "sharded", index=index)
    out = convert(sharded, tmp_path / "m", quant="q4", progress=False)
    reference = tiny_packed_model("mixtral", "q4")
    assert file_hashes(out, skip={MANIFEST_NAME}) == file_hashes(reference, skip={MANIFEST_NAME})
    files = PackedModel(out).manifest.source["files"]
    assert sorted(files) == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def test_transformers_4_config_spelling(tiny_checkpoint, tiny_packed_model, tmp_path):
    folder = tiny_checkpoint("qwen3_moe")
    old = tmp_path / "old"
    shutil.copytree(folder, old)
    config = json.loads((old / "config.json").read_text())
    config["num_experts"] = config.pop("num_local_experts")
    config["rope_theta"] = config.pop("rope_parameters")["rope_theta"]
    config["transformers_version"] = "4.57.1"
    (old / "config.json").write_text(json.dumps(config))
    out = convert(old, tmp_path / "m", quant="none", progress=False)
    packed = PackedModel(out)
    assert packed.config == config
    reference = tiny_packed_model("qwen3_moe", "none")
    assert file_hashes(out, skip={MANIFEST_NAME}) == file_hashes(reference, skip={MANIFEST_NAME})


def test_force_replaces_a_previous_model_and_keeps_foreign_files(tiny_checkpoint, tmp_path):
    out = tmp_path / "m"
    convert(tiny_checkpoint("olmoe"), out, quant="q4", progress=False)
    (out / "notes.txt").write_text("mine")
    convert(tiny_checkpoint("mixtral"), out, quant="none", force=True, progress=False)
    packed = PackedModel(out)
    assert packed.family == "mixtral" and (out / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in out.glob("experts-*.bin")) == ["experts-000.bin", "experts-001.bin"]


def test_cli_convert_and_progress_on_stderr(tiny_checkpoint, tmp_path, capsys):
    from moestream.commands.convert import main
    assert main([str(tiny_checkpoint("olmoe")), str(tmp_path / "m"), "--quant", "q8"]) == 0
    captured = capsys.readouterr()
    assert "wrote" in captured.out and "convert" in captured.err
    assert PackedModel(tmp_path / "m").manifest.quantization["requested"] == {"quant": "q8", "group_size": 64}


@pytest.mark.parametrize("quant", ["q4", "none"])
def test_resident_tensors_streamed_in_row_blocks_give_the_same_file(quant, tiny_checkpoint, tiny_packed_model, tmp_path,
                                                                    monkeypatch):
    from moestream.convert import main as convert_main
    monkeypatch.setattr(convert_main, "BLOCK_BYTES", 1000)  # every matrix read a few rows at a time
    out = convert(tiny_checkpoint("qwen2_moe"), tmp_path / "m", quant=quant, progress=False)
    reference = tiny_packed_model("qwen2_moe", quant)
    assert file_hashes(out) == file_hashes(reference)


def test_worker_threads_give_the_same_bytes(tiny_checkpoint, tiny_packed_model, tmp_path):
    out = convert(tiny_checkpoint("qwen3_moe"), tmp_path / "m", quant="q4", workers=3, progress=False)
    assert file_hashes(out) == file_hashes(tiny_packed_model("qwen3_moe", "q4"))
