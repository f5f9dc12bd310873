"""Fuzzing (hypothesis): the manifest and record reader on truncated, corrupt and hostile input
(every failure a MoestreamError, no crash, no allocation sized by the input), and incremental
detokenization on arbitrary text (the pieces always add up to the decoded text)."""
import json
import shutil
from pathlib import Path

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from moestream.engine.detok import IncrementalDecoder
from moestream.errors import MoestreamError
from moestream.format.manifest import MANIFEST_NAME, read_manifest
from moestream.format.reader import PackedModel

DEMO = Path(__file__).resolve().parents[2] / "moestream" / "demo" / "model"
FAST = settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = tmp_path_factory.mktemp("fuzz") / "model"
    shutil.copytree(DEMO, out)
    return out


def _open_and_read(directory: Path) -> None:
    """Everything a loader does with a manifest before the weights: open, then read records."""
    packed = PackedModel(directory)
    for entry in packed.manifest.expert_layers[:2]:
        for expert in {0, entry.num_experts - 1}:
            packed.expert_tensors(entry.layer, expert)


def _write(directory: Path, data: bytes) -> None:
    (directory / MANIFEST_NAME).write_bytes(data)


@FAST
@given(data=st.data())
def test_truncated_or_corrupt_manifest_bytes(model, data):
    original = (DEMO / MANIFEST_NAME).read_bytes()
    cut = data.draw(st.integers(0, len(original)))
    flips = data.draw(st.lists(st.tuples(st.integers(0, max(0, cut - 1)), st.integers(1, 255)), max_size=4))
    raw = bytearray(original[:cut])
    for at, mask in flips:
        if raw:
            raw[at] ^= mask
    _write(model, bytes(raw))
    try:
        _open_and_read(model)
    except MoestreamError as exc:
        assert "\n" not in str(exc)


HOSTILE_INTS = st.one_of(st.integers(-2**70, 2**70), st.sampled_from([0, -1, 1, 4095, 4096, 2**31, 2**63, 2**64]),
                         st.none(), st.text(max_size=3), st.booleans(), st.floats(allow_nan=True))


@FAST
@given(data=st.data())
def test_hostile_sizes_and_offsets(model, data):
    obj = json.loads((DEMO / MANIFEST_NAME).read_text())
    layer = data.draw(st.sampled_from(obj["expert_layers"]))
    target = data.draw(st.sampled_from(["record_size", "num_experts", "layer", "field.offset", "field.nbytes",
                                        "field.shape", "file", "files.size", "crc32"]))
    value = data.draw(HOSTILE_INTS)
    if target.startswith("field."):
        field = data.draw(st.sampled_from(layer["fields"]))
        key = target.split(".")[1]
        field[key] = [value, 7] if key == "shape" else value
    elif target == "file":
        layer["file"] = data.draw(st.sampled_from(["../dense.safetensors", "/etc/passwd", "", "missing.bin", ".."]))
    elif target == "files.size":
        name = data.draw(st.sampled_from(sorted(obj["files"])))
        obj["files"][name]["size"] = value
    elif target == "crc32":
        layer["crc32"] = [value] * 3
    else:
        layer[target] = value
    assume(json.dumps(obj) != (DEMO / MANIFEST_NAME).read_text())
    _write(model, json.dumps(obj).encode())
    try:
        _open_and_read(model)
    except MoestreamError as exc:
        assert "\n" not in str(exc)


@FAST
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
                    max_leaves=20))
def test_any_json_document_is_refused_clearly(model, doc):
    _write(model, json.dumps(doc).encode())
    with pytest.raises(MoestreamError):
        read_manifest(model)


@pytest.fixture(scope="module")
def tokenizer():
    from moestream.engine.tokenizer import load_tokenizer
    return load_tokenizer(DEMO, {})


@settings(max_examples=80, deadline=2000, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(max_size=60))
def test_incremental_detokenization_adds_up(tokenizer, text):
    ids = tokenizer.encode(text, add_special_tokens=False)
    decoder = IncrementalDecoder(tokenizer.decode)
    pieces = [decoder.push(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == tokenizer.decode(ids)
    assert all("\ufffd" not in p for p in pieces[:-1]) or "\ufffd" in text
    assert tokenizer.decode(ids) == text  # byte-level BPE: any text round-trips
