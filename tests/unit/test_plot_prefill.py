"""scripts/plot_prefill.py draws bench runs' prefill speeds by prompt length and refuses what it cannot draw."""
import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "plot_prefill.py"


def plot(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=120)


def bench_json(path: Path, runs: list[dict]) -> Path:
    path.write_text(json.dumps({"runs": runs}))
    return path


def test_writes_a_png_of_every_run_with_several_lengths(tmp_path):
    prefill = [{"tokens": 512, "tok_s": 7555.0}, {"tokens": 128, "tok_s": 1891.0}, {"tokens": 2048, "tok_s": 23861.0}]
    a = bench_json(tmp_path / "a.json", [{"cache_size": "all", "prefill": prefill},
                                         {"cache_size": "25%", "prefill": prefill[:1]}])
    out = tmp_path / "prefill.png"
    result = plot("--run", f"kept={a}", "--target", "512,10000,2048,20000", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_what_it_cannot_draw_is_one_line(tmp_path):
    one = bench_json(tmp_path / "one.json", [{"cache_size": "all", "prefill": [{"tokens": 512, "tok_s": 1.0}]}])
    for args, needle in ((["--run", f"A={one}"], "no run timed two or more prompt lengths"),
                         (["--run", "nolabel"], "expected LABEL=FILE"),
                         (["--run", f"A={tmp_path / 'missing.json'}"], "not a bench JSON with runs"),
                         (["--run", f"A={one}", "--target", "512"], "expected TOKENS,TOK_S pairs")):
        result = plot(*args, "--out", str(tmp_path / "x.png"))
        assert result.returncode != 0 and needle in result.stderr, result.stderr
        assert "Traceback" not in result.stderr
