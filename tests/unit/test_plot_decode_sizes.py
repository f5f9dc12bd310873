"""scripts/plot_decode_sizes.py draws decode speed against cache size from bench runs, and refuses a
run without a cache size in % or a decode in one line."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_decode_sizes.py"


def run_script(tmp_path, *args):
    return subprocess.run([sys.executable, str(SCRIPT), *args, "--out", str(tmp_path / "sizes.png")],
                          capture_output=True, text=True, timeout=120)


def test_writes_a_png_of_every_run_by_cache_size(tmp_path):
    files = []
    for size, tok_s in (("50%", 104.6), ("10%", 73.7)):  # out of order: joined by size
        path = tmp_path / f"{size[:-1]}.json"
        path.write_text(json.dumps({"runs": [{"cache_size": size, "decode": {"tok_s": tok_s}}]}))
        files.append(str(path))
    result = run_script(tmp_path, "--run", f"auto={','.join(files)}", "--line", "peer=39.5")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "sizes.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_run_without_a_size_in_percent_is_one_line(tmp_path):
    path = tmp_path / "all.json"
    path.write_text(json.dumps({"runs": [{"cache_size": "all", "decode": {"tok_s": 300.0}}]}))
    result = run_script(tmp_path, "--run", f"resident={path}")
    assert result.returncode != 0 and "without a cache size in %" in result.stderr
    assert "Traceback" not in result.stderr
