"""The packed format: streamed safetensors, expert records, manifest, and the PackedModel API."""
import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.errors import FormatError, MoestreamError
from moestream.format.manifest import FIELD_ALIGN, MANIFEST_NAME, RECORD_ALIGN, Manifest, read_manifest
from moestream.format.reader import PackedModel
from moestream.format.records import decode_record, encode_record, plan_record
from moestream.format.safetensors_io import DTYPE_NAMES, SafetensorsFile, TensorEntry, plan_safetensors
from moestream.format.writer import SafetensorsWriter, finish_model, save_safetensors, sha256_file
from moestream.quant.affine import QuantSpec


def sample_tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.norm": torch.randn(7, generator=g).to(torch.bfloat16),  # odd byte length
        "b.weight": torch.randint(0, 2**31 - 1, (3, 5), generator=g, dtype=torch.int64).to(torch.int32).view(torch.uint32),
        "b.scales": torch.randn(3, 1, generator=g).to(torch.float16),
        "c.f32": torch.randn(2, 3, generator=g),
        "d.f64": torch.randn(3, generator=g, dtype=torch.float64),
        "e.mask": torch.tensor([True, False, True]),
        "f.u8": torch.arange(5, dtype=torch.uint8),
        "g.empty": torch.empty(0, 4),
    }


def test_streamed_safetensors_reads_back_with_safe_open(tmp_path):
    tensors = sample_tensors()
    digest = save_safetensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    assert digest.size == (tmp_path / "x.safetensors").stat().st_size
    assert digest.sha256 == sha256_file(tmp_path / "x.safetensors")
    with safe_open(str(tmp_path / "x.safetensors"), framework="pt") as f:
        assert set(f.keys()) == set(tensors) and f.metadata() == {"format": "pt"}
        for name, t in tensors.items():
            got = f.get_tensor(name)
            assert got.dtype == t.dtype and torch.equal(got.view(torch.uint8) if got.dtype == torch.uint32 else got,
                                                        t.view(torch.uint8) if t.dtype == torch.uint32 else t)
    # every tensor starts on a multiple of its item size
    header_len = struct.unpack("<Q", (tmp_path / "x.safetensors").read_bytes()[:8])[0]
    assert (8 + header_len) % 8 == 0
    with SafetensorsFile(tmp_path / "x.safetensors") as f:
        for name in tensors:
            info = f.info(name)
            assert info.start % torch.empty((), dtype=info.torch_dtype).element_size() == 0, name


def test_groups_stay_adjacent_and_order_is_enforced(tmp_path):
    groups = [[TensorEntry("q.weight", "U32", (4, 2)), TensorEntry("q.scales", "BF16", (4, 1)),
               TensorEntry("q.biases", "BF16", (4, 1))], [TensorEntry("n.weight", "F32", (3,))]]
    order, _, offsets = plan_safetensors(groups)
    names = [e.name for g in order for e in g]
    i = names.index("q.weight")
    assert names[i:i + 3] == ["q.weight", "q.scales", "q.biases"]
    assert offsets["q.scales"][0] == offsets["q.weight"][1]
    writer = SafetensorsWriter(tmp_path / "y.safetensors", groups)
    first = writer.order[0][0]
    other = next(e for g in writer.order for e in g if e.name != first.name)
    with pytest.raises(ValueError, match="out of order"):
        writer.write(other.name, torch.zeros(other.shape))
    with pytest.raises(ValueError, match="header says"):
        writer.write(first.name, torch.zeros(9))
    writer.abort()


def test_reader_matches_safe_open_and_reads_rows(tmp_path):
    stack = torch.randn(4, 3, 5)
    save_file({"stack": stack, "other": torch.randn(2)}, str(tmp_path / "s.safetensors"))
    with SafetensorsFile(tmp_path / "s.safetensors") as f:
        assert torch.equal(f.read("stack"), stack)
        assert torch.equal(f.read_rows("stack", 2)[0], stack[2])
        assert torch.equal(f.read_rows("stack", 1, 3), stack[1:4])
        assert f.info("stack").shape == (4, 3, 5) and f.info("stack").dtype == "F32"
        with pytest.raises(IndexError):
            f.read_rows("stack", 3, 2)


def test_reader_names_truncated_and_garbage_files(tmp_path):
    save_file({"w": torch.randn(64, 64)}, str(tmp_path / "ok.safetensors"))
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[: len(data) - 100])
    with pytest.raises(MoestreamError, match=r"cut\.safetensors: truncated safetensors file"):
        SafetensorsFile(tmp_path / "cut.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x13\x37" * 50)
    with pytest.raises(MoestreamError, match=r"junk\.safetensors: corrupt safetensors file"):
        SafetensorsFile(tmp_path / "junk.safetensors")
    bad = json.dumps({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}).encode()
    (tmp_path / "lie.safetensors").write_bytes(struct.pack("<Q", len(bad)) + bad + bytes(4))
    with pytest.raises(MoestreamError, match="needs 8"):
        SafetensorsFile(tmp_path / "lie.safetensors")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    with pytest.raises(MoestreamError, match="truncated"):
        SafetensorsFile(tmp_path / "empty.safetensors")


def test_record_plan_is_aligned_and_round_trips():
    tensors = {"gate_proj.weight": torch.randint(0, 1000, (6, 5), dtype=torch.int32).view(torch.uint32),
               "gate_proj.scales": torch.randn(6, 1).to(torch.bfloat16), "down_proj.weight": torch.randn(3, 7)}
    fields, size = plan_record(tensors)
    assert size % RECORD_ALIGN == 0 and all(f.offset % FIELD_ALIGN == 0 for f in fields)
    record = encode_record(fields, size, tensors)
    assert len(record) == size
    out = decode_record(fields, torch.frombuffer(bytearray(record), dtype=torch.uint8))
    assert torch.equal(out["gate_proj.weight"], tensors["gate_proj.weight"].view(torch.int32))
    assert torch.equal(out["gate_proj.scales"], tensors["gate_proj.scales"])
    assert torch.equal(out["down_proj.weight"], tensors["down_proj.weight"])
    with pytest.raises(ValueError, match="layout says"):
        encode_record(fields, size, {**tensors, "down_proj.weight": torch.randn(3, 8)})


def test_finish_model_from_a_dict_still_works(tmp_path):
    dense = {"model.norm.weight": torch.randn(8)}
    manifest = finish_model(tmp_path, family="qwen3_moe", config={"model_type": "qwen3_moe"}, source={},
                            quantization={"mode": "affine", "tensors": {"model.norm.weight": None}}, dense=dense,
                            expert_layers=[], extra_files=[])
    assert read_manifest(tmp_path).files == manifest.files
    with safe_open(str(tmp_path / "dense.safetensors"), framework="pt") as f:
        assert torch.equal(f.get_tensor("model.norm.weight"), dense["model.norm.weight"])


def test_manifest_json_round_trip(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4")
    obj = json.loads((packed / MANIFEST_NAME).read_text())
    assert Manifest.from_json(obj).to_json() == obj
    assert obj["format"] == "moestream-packed" and obj["family"] == "qwen3_moe"


def test_packed_model_api(tiny_packed_model, tiny_checkpoint):
    packed = PackedModel(tiny_packed_model("qwen3_moe", "q4"))
    assert packed.family == "qwen3_moe" and packed.config["hidden_size"] == 64
    assert [e.layer for e in packed.manifest.expert_layers] == [0, 2]  # mlp_only_layers=[1]
    entry = packed.expert_layer(0)
    raw = packed.read_record(0, 3)
    assert len(raw) == entry.record_size and entry.record_size % RECORD_ALIGN == 0
    stored = packed.expert_tensors(0, 3)
    assert set(stored) == {f"{p}.{k}" for p in ("gate_proj", "up_proj", "down_proj") for k in ("weight", "scales", "biases")}
    assert stored["gate_proj.weight"].shape == (64, 8)
    deq = packed.dequantized_expert(0, 3, torch.float32)
    assert {k: tuple(v.shape) for k, v in deq.items()} == {"gate_proj": (64, 64), "up_proj": (64, 64), "down_proj": (64, 64)}
    assert packed.tensor_spec("model.layers.0.mlp.gate.weight") == QuantSpec(8, 64)  # routers keep 8 bits
    assert packed.tensor_spec("model.norm.weight") == QuantSpec()
    assert packed.dense("model.layers.0.self_attn.q_proj.weight").shape == (64, 64)
    assert "model.layers.0.self_attn.q_proj.scales" not in packed.logical_dense_names()
    with pytest.raises(KeyError):
        packed.expert_layer(1)
    with pytest.raises(IndexError):
        packed.read_record(0, 8)
    with pytest.raises(FormatError, match="missing"):
        packed.raw_dense("nope")


def test_reader_refuses_incomplete_models(tiny_packed_model, tmp_path):
    import shutil
    copy = tmp_path / "m"
    shutil.copytree(tiny_packed_model("olmoe", "q4"), copy)
    with open(copy / "experts-001.bin", "r+b") as fh:
        fh.truncate(4096)
    with pytest.raises(FormatError, match="experts-001.bin: truncated"):
        PackedModel(copy)
    (copy / MANIFEST_NAME).unlink()
    with pytest.raises(FormatError, match="moestream.json is missing"):
        PackedModel(copy)
    (copy / "convert-state.json").write_text("{}")
    with pytest.raises(FormatError, match="--resume"):
        PackedModel(copy)


def test_dtype_names_cover_record_dtypes():
    from moestream.format.records import DTYPE_NAMES as RECORD_NAMES
    for dtype, name in RECORD_NAMES.items():
        assert DTYPE_NAMES[dtype] == name


def _mapped_pages_of(t: torch.Tensor) -> int:
    """Whole pages under `t` present in this process's page table (/proc/self/pagemap, bit 63)."""
    import mmap
    import struct

    start = -(-t.data_ptr() // mmap.PAGESIZE)
    end = (t.data_ptr() + t.numel() * t.element_size()) // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as f:
        f.seek(start * 8)
        entries = struct.unpack(f"{end - start}Q", f.read((end - start) * 8))
    return sum(e >> 63 for e in entries)


def test_a_dequantized_tensor_leaves_its_codes_out_of_ram_and_intact():
    # dense() drops the pages of the codes it read (a budget on the CPU counts the float copy only);
    # the file's bytes are read again, unchanged, when asked for
    from moestream.engine.engine import DEMO_MODEL

    packed = PackedModel(DEMO_MODEL)
    name = "model.embed_tokens.weight"
    assert packed.tensor_spec(name).quantized
    codes = packed.raw_dense(name)
    before = codes.clone()
    assert _mapped_pages_of(codes) > 0  # read: mapped
    assert codes.numel() * codes.element_size() >= 4 * 4096
    first = packed.dense(name)
    assert _mapped_pages_of(codes) == 0  # not one whole page of the codes left mapped in this process
    assert torch.equal(codes, before)  # touched again: the file's bytes
    assert torch.equal(packed.dense(name), first)
