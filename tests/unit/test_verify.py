"""`moestream verify`: hashes, record layout and per-record crc32 of a packed model."""
import json
import shutil

import pytest

from moestream.format.manifest import MANIFEST_NAME
from moestream.format.reader import PackedModel
from moestream.commands.verify import main
from moestream.format.verify import verify


@pytest.fixture
def model(tiny_packed_model, tmp_path):
    copy = tmp_path / "m"
    shutil.copytree(tiny_packed_model("qwen3_moe", "q4"), copy)
    return copy


def flip(path, offset):
    with open(path, "r+b") as fh:
        fh.seek(offset)
        byte = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_intact_model_passes(model, capsys):
    assert main([str(model), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "OK" in out and "16 expert records in 2 layers" in out
    report = verify(model)
    assert report.ok and report.files == len(PackedModel(model).manifest.files)


def test_flipped_byte_in_an_expert_file_names_layer_and_expert(model, capsys):
    entry = PackedModel(model).expert_layer(2)
    flip(model / "experts-002.bin", 5 * entry.record_size + 123)
    assert main([str(model), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "moestream verify: error: experts-002.bin: layer 2 expert 5 is corrupt" in err
    assert "Traceback" not in err


def test_flipped_byte_in_dense_names_the_file(model, capsys):
    size = (model / "dense.safetensors").stat().st_size
    flip(model / "dense.safetensors", size - 10)  # in the tensor data, the header stays readable
    assert main([str(model), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "dense.safetensors: sha256 differs from the manifest" in err


def test_flipped_byte_in_a_tokenizer_file(model, capsys):
    flip(model / "tokenizer.json", 20)
    assert main([str(model), "--no-progress"]) == 1
    assert "tokenizer.json: sha256 differs" in capsys.readouterr().err


def test_truncated_and_missing_files(model, capsys):
    with open(model / "experts-000.bin", "r+b") as fh:
        fh.truncate(4096)
    (model / "tokenizer_config.json").unlink()
    assert main([str(model), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "experts-000.bin: truncated" in err and "tokenizer_config.json: missing" in err


def test_bad_record_layout_in_the_manifest(model):
    manifest = json.loads((model / MANIFEST_NAME).read_text())
    layer = manifest["expert_layers"][0]
    layer["fields"][0]["offset"] = layer["record_size"] - 256  # 2 KiB of words spill past the record end
    layer["crc32"] = layer["crc32"][:-1]
    (model / MANIFEST_NAME).write_text(json.dumps(manifest))
    problems = " | ".join(verify(model).problems)
    assert "lies outside the" in problems and "crc32 values for 8 records" in problems


def test_not_a_model(tmp_path, capsys):
    assert main([str(tmp_path), "--no-progress"]) == 1
    assert "moestream.json is missing" in capsys.readouterr().err
