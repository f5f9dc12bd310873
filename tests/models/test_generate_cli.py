"""`moestream generate` end to end, and its clear one-line errors."""
import json
import subprocess
import sys
from types import SimpleNamespace

from moestream.commands import main


def run(*args):
    return subprocess.run([sys.executable, "-m", "moestream", "generate", *args], capture_output=True, text=True)


def run_here(capfd, *args):
    """The same command in this process (no interpreter and torch start-up per error case); an
    exception escaping main fails the test, as a traceback would."""
    try:
        code = main(["generate", *args])
    except SystemExit as exc:  # argparse's usage errors
        code = exc.code
    out, err = capfd.readouterr()
    return SimpleNamespace(returncode=code, stdout=out, stderr=err)


def test_json_output_and_receipt(tiny_packed_model, tmp_path):
    model = tiny_packed_model("qwen3_moe", "q4")
    receipt = tmp_path / "r.json"
    out = run("--model", str(model), "--prompt", "def f", "--max-new", "6", "--json", "--logprobs", "3",
              "--receipt", str(receipt), "--device", "cpu")
    assert out.returncode == 0, out.stderr
    assert len(out.stdout.strip().splitlines()) == 1  # the JSON object alone
    obj = json.loads(out.stdout)
    assert "expert hit rate" in out.stderr
    assert set(obj) >= {"token_ids", "text", "logprobs", "receipt"}
    assert len(obj["logprobs"]) == len(obj["token_ids"]) and all(len(x) == 3 for x in obj["logprobs"])
    saved = json.loads(receipt.read_text())
    for key in ("prompt_tokens", "generated_tokens", "prefill_s", "decode_s", "prefill_tok_s", "decode_tok_s",
                "hit_rate", "misses", "bytes_read_disk", "bytes_read_host", "read_wait_s", "memory"):
        assert key in saved


def test_plain_output_streams_text_then_stats(tiny_packed_model):
    out = run("--model", str(tiny_packed_model("mixtral", "q4")), "--prompt", "import", "--max-new", "4")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("import")
    assert "expert hit rate" not in out.stdout  # stdout is the text alone
    assert "expert hit rate" in out.stderr.strip().splitlines()[-1]


def one_line_error(out, needle):
    assert out.returncode != 0
    assert "Traceback" not in out.stderr
    lines = [l for l in out.stderr.strip().splitlines() if l.startswith("moestream generate: error:")]
    assert len(lines) == 1 and needle in lines[0], out.stderr


def test_prompt_longer_than_context(tiny_packed_model, capfd):
    out = run_here(capfd, "--model", str(tiny_packed_model("qwen3_moe", "none")), "--prompt", "x " * 50, "--max-context", "16")
    one_line_error(out, "context")


def test_bad_prompt_ids(tiny_packed_model, capfd):
    model = str(tiny_packed_model("qwen3_moe", "none"))
    one_line_error(run_here(capfd, "--model", model, "--prompt-ids", "1,two,3"), "--prompt-ids")
    one_line_error(run_here(capfd, "--model", model, "--prompt-ids", "1,99999"), "vocabulary")


def test_model_directory_that_fails_its_manifest(tiny_packed_model, tmp_path, capfd):
    import shutil
    bad = tmp_path / "bad"
    shutil.copytree(tiny_packed_model("qwen3_moe", "none"), bad)
    experts = sorted(bad.glob("experts-*.bin"))[0]
    experts.write_bytes(experts.read_bytes()[:-4096])
    one_line_error(run_here(capfd, "--model", str(bad)), "experts-")
    (bad / "moestream.json").write_text("{not json")
    one_line_error(run_here(capfd, "--model", str(bad)), "manifest")
    one_line_error(run_here(capfd, "--model", str(tmp_path / "nowhere")), "no such directory")


def test_speculative_flags_give_the_plain_tokens(tiny_packed_model, capfd):
    model = str(tiny_packed_model("qwen3_moe", "q4"))
    base = ["--model", model, "--prompt", "def fibonacci(n):", "--max-new", "24", "--json", "--device", "cpu",
            "--threads", "1", "--temperature", "0.8", "--seed", "5"]
    plain = run_here(capfd, *base, "--draft", "off")
    assert plain.returncode == 0, plain.stderr
    expected = json.loads(plain.stdout)["token_ids"]
    assert json.loads(plain.stdout)["receipt"]["speculative"] is None
    for flags in (["--speculative", "ngram"], ["--speculative", "ngram", "--draft-tokens", "3", "--ngram", "2"],
                  ["--speculative", f"draft:{model}", "--draft-tokens", "auto"]):
        out = run_here(capfd, *base, *flags)
        assert out.returncode == 0, out.stderr
        obj = json.loads(out.stdout)
        assert obj["token_ids"] == expected
        spec = obj["receipt"]["speculative"]
        assert set(spec) >= {"drafter", "drafted", "accepted", "accept_rate", "tokens_per_step"}
        assert "speculative" in out.stderr
    greedy = [a for a in base if a not in ("--temperature", "0.8")]
    hot = run_here(capfd, *greedy, "--hot-head")
    assert hot.returncode == 0, hot.stderr
    assert json.loads(hot.stdout)["token_ids"] == json.loads(run_here(capfd, *greedy).stdout)["token_ids"]
