"""Integrity by default: a flipped byte in any file of a packed model is a one-line error naming
the file (and layer and expert for a record) with nothing on stdout; `--no-verify` runs anyway."""
import json
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from moestream.errors import FormatError
from moestream.format.integrity import CACHE_FILE, check_resident_files
from moestream.format.manifest import read_manifest


def generate(model, *args, env=None):
    return subprocess.run([sys.executable, "-m", "moestream", "generate", "--model", str(model), "--device", "cpu",
                           "--prompt", "def fibonacci(n):", "--max-new", "3", *args],
                          capture_output=True, text=True, env=env)


def flip(path, offset, mask=0x01):
    data = bytearray(path.read_bytes())
    data[offset] ^= mask
    path.write_bytes(bytes(data))


@pytest.fixture
def copy(tiny_packed_model, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_packed_model("qwen3_moe", "q4"), out)
    return out


def routed_record(model, tmp_path):
    """(file, layer, expert) of a record the prompt's first token routes to, from a routing trace."""
    trace = tmp_path / "t.npz"
    out = generate(model, "--trace-routing", str(trace), "--max-new", "1")
    assert out.returncode == 0, out.stderr
    with np.load(trace) as t:
        layer, expert = int(t["layer"][0]), int(t["experts"][0][0])
    entry = read_manifest(model).expert_layer(layer)
    return entry, expert


def assert_refused(out, needle):
    assert out.returncode == 1, out.stderr
    assert out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("moestream generate: error:") and needle in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_flipped_byte_in_an_expert_record(copy, tmp_path):
    entry, expert = routed_record(copy, tmp_path)
    flip(copy / entry.file, expert * entry.record_size + 777)
    out = generate(copy)
    assert_refused(out, f"{entry.file}: layer {entry.layer} expert {expert} is corrupt")
    unchecked = generate(copy, "--no-verify")
    assert unchecked.returncode == 0 and unchecked.stdout.startswith("def fibonacci(n):")
    assert "verify off" in unchecked.stderr


def _header(path):
    data = path.read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return data, n


def test_flipped_byte_in_dense_tensor_data(copy):
    path = copy / "dense.safetensors"
    data, _ = _header(path)
    flip(path, len(data) - 3)
    assert_refused(generate(copy), "dense.safetensors: sha256 differs from the manifest")
    assert generate(copy, "--no-verify").returncode == 0


def test_flipped_byte_in_dense_header(copy):
    path = copy / "dense.safetensors"
    data, n = _header(path)
    at = data.index(b'"pt"', 8, 8 + n) + 2  # the metadata's "pt" -> "pu": still a valid header
    flip(path, at)
    assert_refused(generate(copy), "dense.safetensors: sha256 differs from the manifest")
    assert generate(copy, "--no-verify").returncode == 0


def test_flipped_byte_in_a_tokenizer_file(copy):
    path = copy / "tokenizer.json"
    text = path.read_bytes()
    at = text.index(b"\n")  # newline -> carriage return: still valid JSON, a different file
    flip(path, at, 0x07)
    assert_refused(generate(copy), "tokenizer.json: sha256 differs from the manifest")
    assert generate(copy, "--no-verify").returncode == 0


def test_receipt_and_stats_say_whether_records_were_checked(copy, tmp_path):
    for flag, expected in (([], True), (["--no-verify"], False)):
        receipt = tmp_path / "r.json"
        out = generate(copy, "--receipt", str(receipt), *flag)
        assert out.returncode == 0, out.stderr
        saved = json.loads(receipt.read_text())
        assert saved["verify"] is expected and saved["experts"]["verify"] is expected
        assert saved["threads"] >= 1
        assert f"threads {saved['threads']}, verify {'on' if expected else 'off'}" in out.stderr


def test_digests_are_remembered_against_the_file_identity(copy, tmp_path):
    manifest, cache = read_manifest(copy), tmp_path / "cache"
    first = check_resident_files(copy, manifest, cache_dir=cache)
    assert first.files == first.hashed >= 2 and (cache / CACHE_FILE).is_file()
    from moestream.format import integrity
    integrity._memo.clear()  # a new process: only the file remembers
    assert check_resident_files(copy, manifest, cache_dir=cache).hashed == 0
    # a rewrite changes the identity (mtime): hashed again, and the damage is found
    path = copy / "dense.safetensors"
    flip(path, 100)
    with pytest.raises(FormatError, match="dense.safetensors: sha256 differs"):
        check_resident_files(copy, manifest, cache_dir=cache)
    flip(path, 100)
    assert check_resident_files(copy, manifest, cache_dir=cache).hashed == 1
    # a damaged cache file costs a re-hash, never a wrong answer
    (cache / CACHE_FILE).write_text("{not json")
    integrity._memo.clear()
    assert check_resident_files(copy, manifest, cache_dir=cache).hashed == first.files
