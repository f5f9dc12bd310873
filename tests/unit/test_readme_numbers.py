"""scripts/readme_numbers.py: the README's measured numbers equal what the committed benchmark JSON
gives; a changed number is named by its block and rewritten back; broken markers are one-line errors."""
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "readme_numbers.py"
README = ROOT / "README.md"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=60)


def test_readme_numbers_match_the_json():
    result = run("--check")
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("block, old, new", [
    ("demo-cache-sweep", "51.7 / 64.9", "51.7 / 65.9"),
    ("h200-q30-cache-sizes", "| 108.4 tok/s | 0.948 |", "| 108.4 tok/s | 0.958 |"),
    ("crc32-cost", "per core, against 66 µs", "per core, against 60 µs"),
    ("h200-server-batching", "4.08× and 4.05×", "4.18× and 4.05×"),
])
def test_a_changed_number_is_named_and_rewritten(tmp_path, block, old, new):
    original = README.read_text(encoding="utf-8")
    assert original.count(old) == 1
    stale = tmp_path / "README.md"
    stale.write_text(original.replace(old, new), encoding="utf-8")

    result = run("--check", "--readme", str(stale))
    assert result.returncode == 1
    assert f"block '{block}' differs" in result.stderr
    assert result.stderr.count("differs") == 1  # only the block that changed

    result = run("--readme", str(stale))
    assert result.returncode == 0, result.stderr
    assert stale.read_text(encoding="utf-8") == original


def test_prose_outside_the_blocks_is_left_alone(tmp_path):
    original = README.read_text(encoding="utf-8")
    edited = tmp_path / "README.md"
    edited.write_text(original.replace("**Conversion** streams", "**Conversion** still streams"), encoding="utf-8")
    assert run("--check", "--readme", str(edited)).returncode == 0
    assert run("--readme", str(edited)).returncode == 0
    assert "**Conversion** still streams" in edited.read_text(encoding="utf-8")


@pytest.mark.parametrize("edit, message", [
    (lambda s: s.replace("numbers:begin crc32-cost", "numbers:begin crc64-cost"), "unknown numbers block(s): crc64-cost"),
    (lambda s: s.replace("<!-- numbers:begin synth-hit-25 -->", ""), "unbalanced numbers markers"),
    (lambda s: s.replace("layer) it decodes <!-- numbers:begin h200-device-25", "layer) it decodes\n<!-- numbers:begin h200-device-25"),
     "inline numbers block 'h200-device-25' begins a line"),
])
def test_broken_markers_are_one_line_errors(tmp_path, edit, message):
    original = README.read_text(encoding="utf-8")
    broken = tmp_path / "README.md"
    changed = edit(original)
    assert changed != original
    broken.write_text(changed, encoding="utf-8")
    result = run("--check", "--readme", str(broken))
    assert result.returncode == 2
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "Traceback" not in result.stderr
