"""The `moestream` command as a whole: --version, a reader that goes away, short --help, the text's
last line before the stats line, progress on stderr, small-context models, the declared dependencies."""
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

import moestream
from moestream.commands import main
from moestream.engine.engine import DEMO_MODEL

REPO = Path(__file__).resolve().parents[2]
needs_demo = pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not in the tree")
# figures that belong in docs/PERFORMANCE.md, not in --help: speedups, rates, the GPUs they were measured on
FIGURES = re.compile(r"\d(\.\d+)?x\b|\d\s*(tok/s|GB/s|ms\b)|\bH[12]00\b")


def python_env(**extra) -> dict:
    """This checkout first on the path; PYTHONUNBUFFERED off, as in a user's shell."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return {**env, **extra}


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"moestream {moestream.__version__}\n"
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "version" in project.get("dynamic", []) or project["version"] == moestream.__version__


@pytest.mark.parametrize("args", [["generate", "--help"], ["bench", "--help"],
                                  pytest.param(["generate", "--max-new", "8", "--draft", "off"], marks=needs_demo)],
                         ids=["generate-help", "bench-help", "generate-text"])
def test_a_reader_that_goes_away_gives_no_traceback(args):
    """`moestream generate --help | head`: the reader has gone before anything is written."""
    proc = subprocess.Popen([sys.executable, "-m", "moestream", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=python_env(), cwd=REPO)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141, err
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_ctrl_c_is_one_line(monkeypatch, capsys):
    import moestream.commands.verify as verify

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(verify, "main", interrupted)
    assert main(["verify", "somewhere"]) == 130
    assert capsys.readouterr().err == "moestream: interrupted\n"


@pytest.mark.parametrize("command", ["generate", "serve", "bench"])
def test_help_is_one_screen_of_short_lines(command, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) <= 80, len(lines)
    assert max(len(line) for line in lines) <= 100
    assert [line for line in lines if FIGURES.search(line)] == []
    assert any(line.lstrip().startswith("--cache-size ") for line in lines)


@needs_demo
@pytest.mark.parametrize("json_out", [False, True], ids=["text", "json"])
def test_the_output_ends_its_line_before_the_stats_line(json_out):
    """stdout and stderr into one pipe (`2>&1 | less`): the stats line starts a line of its own."""
    out = subprocess.run([sys.executable, "-m", "moestream", "generate", "--max-new", "4", "--draft", "off",
                          "--device", "cpu", *(["--json"] if json_out else [])],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=python_env(), cwd=REPO, timeout=300)
    text = out.stdout.decode()
    assert out.returncode == 0, text
    stats = text.index("[moestream] prompt")
    assert stats > 0 and text[stats - 1] == "\n", text


def test_bench_shows_its_phases_unless_told_not_to(tiny_packed_model, capsys):
    model = str(tiny_packed_model("qwen3_moe", "q4"))
    base = ["bench", "--model", model, "--device", "cpu", "--prefill-tokens", "16", "--decode-tokens", "4"]
    assert main(base) == 0
    err = capsys.readouterr().err
    assert "bench, cache auto: load" in err and "prefill 16" in err and "decode 4" in err, err
    assert main([*base, "--no-progress"]) == 0
    assert "bench, cache" not in capsys.readouterr().err


def test_bench_leaves_out_default_lengths_the_context_cannot_hold(tiny_packed_model, capsys):
    """The tiny model's context is 256 tokens: the default lengths (512, 2048) are left out, saying so."""
    model = str(tiny_packed_model("qwen3_moe", "q4"))
    assert main(["bench", "--model", model, "--device", "cpu", "--decode-tokens", "2", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "the context holds 256 tokens: prefill lengths 512, 2048 left out" in captured.err
    assert "decode" in captured.out


def test_fit_lookahead_on_a_small_context_model(tiny_packed_model, tmp_path, capsys):
    """Each file's tokens are one prefill: by default no more than the context holds (the tiny model: 256)."""
    model = str(tiny_packed_model("qwen3_moe", "q4"))
    text = Path(os.__file__).parent / "json"
    out = tmp_path / "maps.safetensors"
    assert main(["fit-lookahead", model, str(out), "--text", str(text), "--tokens", "1024"]) == 0, \
        capsys.readouterr().err
    assert out.is_file()
    assert "Traceback" not in capsys.readouterr().err


def test_plotting_needs_no_extra_install():
    """bench --plot, heatmap, simulate --plot and ab --plot draw with matplotlib: a plain install brings it."""
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.match(r"matplotlib\b", d) for d in deps), deps


def test_pyproject_script_is_the_dispatcher():
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, name = scripts["moestream"].partition(":")
    assert module == "moestream.commands" and name == "main"
