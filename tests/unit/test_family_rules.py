"""convert, synth, export_hf and the memory ledger take every family rule from the family's module.

For each family the packed model holds exactly what the family's build takes, at the bits its
quant_predicate gives, and survives export -> convert byte for byte. A family that exists only in
this file (qwen3_moe's model under other checkpoint names) converts, exports, synthesizes and runs:
nothing outside a family's file knows a family."""
import hashlib
import json
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import moestream.bench.synth as synth_module
import moestream.models as models
from moestream.convert.layout import ExpertNames
from moestream.convert.main import convert
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.convert.export_hf import export_hf
from moestream.format.manifest import EXPERT_PROJECTIONS
from moestream.format.reader import PackedModel
from moestream.models import qwen3_moe
from moestream.models.registry import family_module, weight_shapes
from moestream.quant.affine import QuantSpec, can_quantize
from tiny import FAMILY_CONFIGS, load_all, nest_text_fields

FAMILIES = list(models.SUPPORTED_FAMILIES)
PROMPT = [5, 17, 42, 99, 200]


def model_hashes(folder: Path) -> dict[str, str]:
    """The packed model's weights: dense.safetensors and the expert record files."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(Path(folder).iterdir())
            if p.name == "dense.safetensors" or p.name.startswith("experts-")}


def assert_follows_the_family(packed: PackedModel, bits: int | None) -> None:
    """Resident tensors: the names and shapes the family's build takes, each at the bits its
    quant_predicate gives; expert layers: args.moe_layers(), records of args.expert_shapes()."""
    family = family_module(packed.family)
    args = family.ModelArgs.from_dict(packed.config)
    names = packed.logical_dense_names()
    want = weight_shapes(packed.family, packed.config, present=names)
    assert sorted(names) == sorted(want)
    for name, shape in want.items():
        assert tuple(packed.dense(name).shape) == shape, name
        spec = packed.tensor_spec(name)
        quantizable = bits is not None and name.endswith(".weight") and can_quantize(shape, 64)
        assert spec.bits == (family.quant_predicate(name, bits) if quantizable else None), name
    assert [e.layer for e in packed.manifest.expert_layers] == args.moe_layers()
    for entry in packed.manifest.expert_layers:
        assert entry.num_experts == args.num_experts
        record = packed.dequantized_expert(entry.layer, entry.num_experts - 1)
        assert {p: tuple(w.shape) for p, w in record.items()} == args.expert_shapes()


def run_briefly(folder: Path) -> torch.Tensor:
    engine = Engine.load(folder, options=EngineOptions(device="cpu", threads=1, max_context=64))
    try:
        # the ledger's KV line is the pool the engine allocates (args.kv_layout())
        assert engine.plan.ledger.kv_cache == engine.pool.nbytes
        logits, _ = engine.prefill(PROMPT)
        assert torch.isfinite(logits).all()
        assert len(list(engine.generate(PROMPT, max_new_tokens=3, stop_at_eos=False))) == 3
        return logits
    finally:
        engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_convert_takes_the_family_rules(family, tiny_checkpoint, tiny_packed_model):
    """Every checkpoint tensor is either a routed expert, named as the family names them, or a
    resident tensor the family's build takes; q4 keeps each at the family's bits."""
    names = ExpertNames(family_module(family))
    src = load_all(tiny_checkpoint(family))
    sanitize = family_module(family).sanitize  # checkpoint names -> packed names (None: not kept)
    experts = {n for n in src if names.expert(sanitize(n) or "") or names.fused.match(sanitize(n) or "")}
    packed = PackedModel(tiny_packed_model(family, "q4"))
    assert experts and {sanitize(n) for n in set(src) - experts} - {None} == set(packed.logical_dense_names())
    assert_follows_the_family(packed, 4)
    assert_follows_the_family(PackedModel(tiny_packed_model(family, "none")), None)


@pytest.mark.parametrize("family", FAMILIES)
def test_export_then_convert_gives_the_same_model(family, tiny_packed_model, tmp_path):
    """export_hf names experts as the family's checkpoints do, so converting its output again
    finds every expert and gives the same bytes."""
    packed = tiny_packed_model(family, "none")
    exported = export_hf(packed, tmp_path / "hf")
    again = convert(exported, tmp_path / "again", quant="none", progress=False)
    assert model_hashes(again) == model_hashes(packed)


def tiny_shape(family: str, **extra) -> dict:
    return nest_text_fields(dict(model_type=family, vocab_size=256, rope_theta=10000.0, max_position_embeddings=128,
                                 eos_token_id=0, **FAMILY_CONFIGS[family], **extra))


@pytest.mark.parametrize("family", FAMILIES)
def test_synth_writes_what_the_family_takes(family, tmp_path, monkeypatch):
    monkeypatch.setitem(synth_module.SHAPES, f"tiny-{family}", tiny_shape(family))
    out = synth_module.synth(f"tiny-{family}", tmp_path / "m", quant="q4")
    assert_follows_the_family(PackedModel(out), 4)
    run_briefly(out)


# -- a family registered only here ---------------------------------------------------------------

FAKE = "fake_moe"
FAKE_NAMES = {"gate_proj": "wg", "up_proj": "wu", "down_proj": "wd"}


def fake_sanitize(name: str) -> str | None:
    """The fake checkpoints call attention `attention` and carry rotary buffers."""
    return None if name.endswith(".inv_freq") else name.replace(".attention.", ".self_attn.")


@pytest.fixture
def fake_family(monkeypatch):
    """qwen3_moe's model as a family whose checkpoints name experts `ffn.experts.E.wg` and attention
    `attention`, registered the way a family file is: a module and a SUPPORTED_FAMILIES entry."""
    module = types.ModuleType(f"moestream.models.{FAKE}")
    module.ModelArgs = qwen3_moe.ModelArgs
    module.EXPERT_MODULE, module.EXPERT_NAMES = "ffn", FAKE_NAMES
    module.sanitize, module.quant_predicate, module.build = fake_sanitize, qwen3_moe.quant_predicate, qwen3_moe.build
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(models, "SUPPORTED_FAMILIES", (*models.SUPPORTED_FAMILIES, FAKE))
    return module


def fake_checkpoint(folder: Path, out: Path, *, expert_names: bool = True) -> Path:
    """The qwen3_moe checkpoint's weights under the fake family's names (experts under their
    qwen3 names when expert_names is False), plus a rotary buffer that is not a weight."""
    out.mkdir()
    for p in folder.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copy(p, out / p.name)
    qwen = ExpertNames(qwen3_moe)
    renamed = {}
    for name, t in load_all(folder).items():
        key = qwen.expert(name)
        if key and expert_names:
            layer, expert, proj = key
            name = f"model.layers.{layer}.ffn.experts.{expert}.{FAKE_NAMES[proj]}.weight"
        renamed[name.replace(".self_attn.", ".attention.")] = t
    renamed["model.layers.0.attention.rotary_emb.inv_freq"] = torch.ones(8)
    save_file(renamed, str(out / "model.safetensors"))
    config = json.loads((folder / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "model_type": FAKE}))
    return out


def test_a_family_known_only_to_its_module_converts_exports_and_runs(fake_family, tiny_checkpoint, tiny_packed_model,
                                                                     tmp_path):
    src = fake_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path / "src")
    assert any(".ffn.experts.3.wu.weight" in n for n in load_all(src))
    out = convert(src, tmp_path / "m", quant="q4", progress=False)
    packed = PackedModel(out)
    assert packed.family == FAKE
    assert_follows_the_family(packed, 4)
    # the same weights as qwen3_moe's checkpoint, found through the fake family's names
    reference = tiny_packed_model("qwen3_moe", "q4")
    assert model_hashes(out) == model_hashes(reference)
    assert torch.equal(run_briefly(out), run_briefly(reference))

    # export names the experts as the fake family does, and converting that gives the same model
    floats = convert(src, tmp_path / "floats", quant="none", progress=False)
    exported = export_hf(floats, tmp_path / "hf")
    names = set(load_all(exported))
    assert "model.layers.2.ffn.experts.7.wd.weight" in names and not any(".mlp.experts." in n for n in names)
    assert model_hashes(convert(exported, tmp_path / "again", quant="none", progress=False)) == model_hashes(floats)


def test_a_family_known_only_to_its_module_synthesizes(fake_family, tmp_path, monkeypatch):
    monkeypatch.setitem(synth_module.SHAPES, "tiny-fake", {**tiny_shape("qwen3_moe"), "model_type": FAKE})
    out = synth_module.synth("tiny-fake", tmp_path / "m", quant="q4")
    assert PackedModel(out).family == FAKE
    assert_follows_the_family(PackedModel(out), 4)
    run_briefly(out)


def test_checkpoint_names_of_another_family_are_refused_in_one_line(fake_family, tiny_checkpoint, tmp_path):
    """Experts under qwen3_moe's names are not the fake family's experts: a clear error, nothing written."""
    src = fake_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path / "src", expert_names=False)
    with pytest.raises(MoestreamError, match=r"^layer 0: no routed-expert tensors, but config\.json makes it an MoE "
                                             r"layer$"):
        convert(src, tmp_path / "m", progress=False)
    assert not (tmp_path / "m").exists()


def test_resident_tensors_are_checked_against_the_family_before_writing(tiny_checkpoint, tmp_path):
    """A resident tensor the family does not take, one it takes but is missing, and one of another
    shape: each refused in one line naming it, before OUT exists."""
    folder = tiny_checkpoint("olmoe")
    cases = {
        "extra": (lambda t: t.update({"model.layers.0.self_attn.extra.weight": torch.zeros(4, 64)}),
                  r"^model\.layers\.0\.self_attn\.extra\.weight: not a weight of the olmoe model of this config\.json$"),
        "missing": (lambda t: (t.pop("model.layers.1.self_attn.q_norm.weight"), t.pop("model.norm.weight")),
                    r"^model\.layers\.1\.self_attn\.q_norm\.weight is missing \(the olmoe model of this config\.json "
                    r"takes it; 1 more are missing\)$"),
        "shape": (lambda t: t.update({"model.layers.1.self_attn.k_norm.weight": torch.ones(16)}),
                  r"^model\.layers\.1\.self_attn\.k_norm\.weight: shape \[16\], but config\.json implies \[64\]$"),
    }
    for case, (edit, pattern) in cases.items():
        src = tmp_path / f"src-{case}"
        shutil.copytree(folder, src)
        tensors = load_all(src)
        edit(tensors)
        save_file(tensors, str(src / "model.safetensors"))
        with pytest.raises(MoestreamError, match=pattern):
            convert(src, tmp_path / f"out-{case}", progress=False)
        assert not (tmp_path / f"out-{case}").exists()


def test_export_names_each_projection_as_the_family_does(tiny_checkpoint, tiny_packed_model, tmp_path):
    """Mixtral's experts come back as block_sparse_moe.experts.E.w1/w3/w2, the checkpoint's own names."""
    exported = set(load_all(export_hf(tiny_packed_model("mixtral", "none"), tmp_path / "hf")))
    assert exported == set(load_all(tiny_checkpoint("mixtral")))
    module = family_module("mixtral")
    assert {f"model.layers.1.{module.EXPERT_MODULE}.experts.5.{module.EXPERT_NAMES[p]}.weight"
            for p in EXPERT_PROJECTIONS} <= exported


def test_quant_spec_of_a_family_matrix_follows_quant_predicate():
    """The qwen2_moe family keeps its shared expert's gate at 8 bits; convert asks, it does not know."""
    from moestream.convert.resident import dense_spec
    qwen2 = family_module("qwen2_moe")
    assert dense_spec(qwen2, "model.layers.0.mlp.shared_expert_gate.weight", [1, 64], 4, 64) == QuantSpec(8, 64)
    assert dense_spec(qwen2, "model.layers.0.mlp.shared_expert.up_proj.weight", [128, 64], 4, 64) == QuantSpec(4, 64)
    assert dense_spec(qwen2, "model.layers.0.self_attn.q_proj.bias", [64], 4, 64) == QuantSpec()
