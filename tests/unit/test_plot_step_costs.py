"""scripts/plot_step_costs.py draws bench --step-tokens runs and refuses files without step costs."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_step_costs.py"


def bench_json(path: Path, runs: list[dict]) -> Path:
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_writes_a_png_of_every_run_with_step_costs(tmp_path):
    costs = {"step_cost": {"step_ms": {"1": 3.5, "2": 4.5, "16": 12.0}}}
    a = bench_json(tmp_path / "a.json", [{"cache_size": "all", **costs}, {"cache_size": "25%", **costs},
                                         {"cache_size": "10%"}])
    out = tmp_path / "steps.png"
    result = subprocess.run([sys.executable, str(SCRIPT), "--run", f"A={a}", "--out", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_file_without_step_costs_is_one_line(tmp_path):
    b = bench_json(tmp_path / "b.json", [{"cache_size": "all"}])
    result = subprocess.run([sys.executable, str(SCRIPT), "--run", f"B={b}", "--out", str(tmp_path / "x.png")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "no run has step costs" in result.stderr
    assert "Traceback" not in result.stderr
    result = subprocess.run([sys.executable, str(SCRIPT), "--run", "nolabel", "--out", str(tmp_path / "x.png")],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "expected LABEL=FILE" in result.stderr
