"""A killed conversion continued with --resume gives the same bytes as an uninterrupted one."""
import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from moestream.convert.main import convert
from moestream.errors import FormatError, MoestreamError
from moestream.format import writer as writer_module
from moestream.format.reader import PackedModel

REPO = Path(__file__).resolve().parents[2]


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "moestream", "convert", *map(str, args), "--no-progress"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint, tmp_path_factory):
    src = tiny_checkpoint("qwen3_moe")
    out = convert(src, tmp_path_factory.mktemp("ref") / "m", quant="q4", progress=False)
    return src, file_hashes(out)


def interrupt_in_layer(monkeypatch, layer: int):
    """Make the writer of `layer`'s records stop the conversion the way Ctrl-C would."""
    real = writer_module.ExpertFileWriter.write

    def write(self, expert, tensors):
        if self.entry.layer == layer and expert == 3:
            raise KeyboardInterrupt
        real(self, expert, tensors)
    monkeypatch.setattr(writer_module.ExpertFileWriter, "write", write)


def test_killed_conversion_resumes_to_identical_bytes(reference, tmp_path):
    src, expected = reference
    out = tmp_path / "m"
    killed = run_cli(src, out, "--kill-after-layers", "1")  # exits abruptly inside the second MoE layer
    assert killed.returncode == 75, killed.stderr
    assert (out / "convert-state.json").exists() and not (out / "moestream.json").exists()
    assert sorted(json.loads((out / "convert-state.json").read_text())["steps"]) == ["dense", "layer-000"]
    with pytest.raises(FormatError, match="--resume"):
        PackedModel(out)
    before = file_hashes(out)
    with pytest.raises(MoestreamError, match="use --force to overwrite it or --resume to continue"):
        convert(src, out, quant="q4", progress=False)
    assert file_hashes(out) == before
    resumed = run_cli(src, out, "--resume")
    assert resumed.returncode == 0, resumed.stderr
    assert file_hashes(out) == expected


def test_resume_redoes_a_damaged_finished_file(reference, tmp_path, monkeypatch):
    src, expected = reference
    out = tmp_path / "m"
    interrupt_in_layer(monkeypatch, 2)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, quant="q4", progress=False)
    monkeypatch.undo()
    steps = json.loads((out / "convert-state.json").read_text())["steps"]
    assert sorted(steps) == ["dense", "layer-000"]
    with open(out / "experts-000.bin", "r+b") as fh:  # damaged after it was recorded as finished
        fh.seek(10)
        fh.write(b"\xff\xff")
    convert(src, out, quant="q4", resume=True, progress=False)
    assert file_hashes(out) == expected


def test_resume_refuses_different_options(reference, tmp_path, monkeypatch):
    src, _ = reference
    out = tmp_path / "m"
    interrupt_in_layer(monkeypatch, 0)
    with pytest.raises(KeyboardInterrupt):
        convert(src, out, quant="q4", progress=False)
    monkeypatch.undo()
    before = file_hashes(out)
    with pytest.raises(MoestreamError, match=r"used quant=\"q4\", not \"q8\"; resume with the same options"):
        convert(src, out, quant="q8", resume=True, progress=False)
    with pytest.raises(MoestreamError, match=r"used group_size=64, not 32"):
        convert(src, out, quant="q4", group_size=32, resume=True, progress=False)
    assert file_hashes(out) == before


def test_resume_of_a_finished_conversion(reference, tmp_path):
    src, expected = reference
    out = convert(src, tmp_path / "m", quant="q4", progress=False)
    convert(src, out, quant="q4", resume=True, progress=False)  # nothing to do
    assert file_hashes(out) == expected
    with pytest.raises(MoestreamError, match="holds a finished conversion with quant"):
        convert(src, out, quant="none", resume=True, progress=False)


def test_resume_into_an_empty_out_just_converts(reference, tmp_path):
    src, expected = reference
    out = convert(src, tmp_path / "fresh", quant="q4", resume=True, progress=False)
    assert file_hashes(out) == expected
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x").write_text("x")
    with pytest.raises(MoestreamError, match="nothing to resume"):
        convert(src, tmp_path / "other", quant="q4", resume=True, progress=False)
