"""Bad inputs to `moestream convert`: one clear line, a non-zero exit, and nothing lost."""
import errno
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moestream.convert.main import convert
from moestream.errors import MoestreamError
from moestream.format import writer as writer_module
from moestream.format.reader import PackedModel

REPO = Path(__file__).resolve().parents[2]


def snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def src(tiny_checkpoint, tmp_path):
    """A private copy of a tiny qwen3_moe checkpoint that a test may damage."""
    copy = tmp_path / "src"
    shutil.copytree(tiny_checkpoint("qwen3_moe"), copy)
    return copy


def rewrite_tensors(folder: Path, edit) -> None:
    path = folder / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    edit(tensors)
    save_file(tensors, str(path))


def edit_config(folder: Path, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))


def expect_error(src_folder, out, pattern, **kwargs):
    before = snapshot(src_folder) if Path(src_folder).is_dir() else None
    with pytest.raises(MoestreamError, match=pattern) as info:
        convert(src_folder, out, progress=False, **kwargs)
    assert "\n" not in str(info.value)
    if before is not None:
        assert snapshot(src_folder) == before  # SRC untouched
    return info.value


def test_missing_path(tmp_path):
    expect_error(tmp_path / "nope", tmp_path / "out", r"nope: no such file or directory")
    assert not (tmp_path / "out").exists()


def test_folder_that_is_no_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    expect_error(tmp_path / "empty", tmp_path / "out", r"not a Hugging Face checkpoint \(config.json is missing\)")
    (tmp_path / "empty" / "config.json").write_text(json.dumps({"model_type": "olmoe"}))
    expect_error(tmp_path / "empty", tmp_path / "out", r"no \*\.safetensors files")
    (tmp_path / "empty" / "config.json").write_text("{not json")
    expect_error(tmp_path / "empty", tmp_path / "out", r"config.json: not valid JSON")


def test_truncated_safetensors(src, tmp_path):
    path = src / "model.safetensors"
    os.truncate(path, path.stat().st_size - 1000)
    expect_error(src, tmp_path / "out", r"model\.safetensors: truncated safetensors file")


def test_corrupt_safetensors_header(src, tmp_path):
    with open(src / "model.safetensors", "r+b") as fh:
        fh.write(b"\xde\xad\xbe\xef\xde\xad\xbe\xef")
    expect_error(src, tmp_path / "out", r"model\.safetensors: corrupt safetensors file")


def test_unsupported_model_type_lists_supported(src, tmp_path):
    edit_config(src, model_type="llama")
    expect_error(src, tmp_path / "out", r"model_type 'llama' is not supported \(supported: qwen3_moe, qwen2_moe, mixtral, olmoe, glm4_moe, deepseek_v3, glm4_moe_lite, gemma4_text, gemma4, kimi_k25, gpt_oss, minimax_m2, qwen3_next, qwen3_5_moe, qwen3_5_moe_text\)")


def test_expert_with_wrong_shape_is_named(src, tmp_path):
    rewrite_tensors(src, lambda t: t.update({"model.layers.2.mlp.experts.3.gate_proj.weight": torch.zeros(32, 64)}))
    expect_error(src, tmp_path / "out", r"model\.layers\.2\.mlp\.experts\.3\.gate_proj\.weight: shape \[32, 64\], "
                                        r"but config\.json implies \[64, 64\] \(moe_intermediate_size × hidden_size\)")


def test_wrong_number_of_experts(src, tmp_path):
    edit_config(src, num_local_experts=9)
    expect_error(src, tmp_path / "out", r"model\.layers\.0\.mlp\.experts\.8\.gate_proj\.weight is missing "
                                        r"\(config\.json says num_local_experts=9\)")
    edit_config(src, num_local_experts=7)
    expect_error(src, tmp_path / "out", r"model\.layers\.0\.mlp\.experts\.7: expert index 7, but config\.json says "
                                        r"num_local_experts=7")


def test_fused_stack_with_wrong_count(src, tmp_path):
    def fuse_wrongly(tensors):
        for layer in (0, 2):
            p = f"model.layers.{layer}.mlp.experts"
            gate_up = [torch.cat([tensors.pop(f"{p}.{e}.gate_proj.weight"), tensors.pop(f"{p}.{e}.up_proj.weight")]) for e in range(8)]
            down = [tensors.pop(f"{p}.{e}.down_proj.weight") for e in range(8)]
            tensors[f"{p}.gate_up_proj"] = torch.stack(gate_up[:7])
            tensors[f"{p}.down_proj"] = torch.stack(down[:7])
    rewrite_tensors(src, fuse_wrongly)
    expect_error(src, tmp_path / "out", r"model\.layers\.0\.mlp\.experts\.gate_up_proj: 7 experts, but config\.json "
                                        r"says num_local_experts=8")


def test_experts_in_a_layer_config_calls_dense(src, tmp_path):
    edit_config(src, mlp_only_layers=[0, 1])
    expect_error(src, tmp_path / "out", r"model\.layers\.0\.mlp: routed-expert tensors in layer 0, which config\.json")


def test_router_rows_must_match_experts(src, tmp_path):
    rewrite_tensors(src, lambda t: t.update({"model.layers.0.mlp.gate.weight": torch.zeros(7, 64)}))
    expect_error(src, tmp_path / "out", r"model\.layers\.0\.mlp\.gate\.weight: shape \[7, 64\]")


def test_no_space_left_on_device(src, tmp_path, monkeypatch):
    def full(self, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(writer_module.OutputFile, "_write_raw", full)
    out = tmp_path / "out"
    err = expect_error(src, out, r"^no space left on device writing .*dense\.safetensors")
    assert "--resume" in str(err)
    assert not (out / "moestream.json").exists() and (out / "convert-state.json").exists()


def test_no_space_in_an_expert_file_then_resume(src, tmp_path, monkeypatch):
    real = writer_module.OutputFile._write_raw

    def full_for_experts(self, data):
        if self.path.name == "experts-002.bin":
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)
    monkeypatch.setattr(writer_module.OutputFile, "_write_raw", full_for_experts)
    out = tmp_path / "out"
    expect_error(src, out, r"no space left on device writing .*experts-002\.bin")
    monkeypatch.setattr(writer_module.OutputFile, "_write_raw", real)
    convert(src, out, resume=True, progress=False)
    PackedModel(out)


def test_existing_out_is_never_overwritten_without_force(src, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    expect_error(src, out, r"out: exists and is not empty \(use --force")
    assert snapshot(out) == {"precious.txt": hashlib.sha256(b"keep me").hexdigest()}


def test_bad_input_leaves_an_existing_model_alone_even_with_force(src, tiny_packed_model, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(tiny_packed_model("olmoe", "q4"), out)
    before = snapshot(out)
    rewrite_tensors(src, lambda t: t.update({"model.layers.0.mlp.experts.0.up_proj.weight": torch.zeros(64, 32)}))
    expect_error(src, out, r"experts\.0\.up_proj\.weight: shape", force=True)
    assert snapshot(out) == before


def test_out_must_not_be_or_contain_src(src, tmp_path):
    expect_error(src, src, r"OUT must not be the source folder or contain it", force=True)
    expect_error(src, tmp_path, r"OUT must not be the source folder or contain it", force=True)


def test_option_errors(src, tmp_path):
    expect_error(src, tmp_path / "o", r"--revision applies to Hub repos", revision="main")
    expect_error(src, tmp_path / "o", r"--force and --resume exclude each other", force=True, resume=True)
    expect_error(src, tmp_path / "o", r"group size 48 is not supported", group_size=48)
    expect_error(src, tmp_path / "o", r"quantization 'q3' is not supported", quant="q3")


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "moestream", "convert", *map(str, args), "--no-progress"],
                          cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=120)


def assert_one_line_error(proc, pattern):
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.startswith("moestream convert: error:")]
    assert len(lines) == 1 and __import__("re").search(pattern, lines[0]), proc.stderr


def test_cli_truncated_checkpoint_exits_with_one_line(src, tmp_path):
    path = src / "model.safetensors"
    os.truncate(path, path.stat().st_size // 2)
    proc = run_cli(src, tmp_path / "out")
    assert_one_line_error(proc, r"model\.safetensors: truncated safetensors file")
    assert not (tmp_path / "out").exists()


def test_cli_offline_hub_repo_fails_with_one_line(tmp_path):
    proc = run_cli("made-up-org-xyz/no-such-moe-model", tmp_path / "out",
                   env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")})
    assert_one_line_error(proc, r"made-up-org-xyz/no-such-moe-model: not a local folder, not in the Hugging Face "
                                r"cache, and the Hub cannot be reached \(offline, or HF_HUB_OFFLINE is set\)")


def test_hub_source_records_repo_and_revision(tiny_checkpoint, tmp_path, monkeypatch):
    """A stand-in snapshot_download: the Hub cache layout, with shards fetched by the index's names."""
    import huggingface_hub
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "cache" / "snapshots" / commit
    shutil.copytree(tiny_checkpoint("olmoe"), snap)
    (snap / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {k: "model.safetensors" for k in safe_open(str(snap / "model.safetensors"), "pt").keys()}}))
    calls = []

    def fake_snapshot_download(repo_id, *, revision=None, allow_patterns=None, **kw):
        calls.append((repo_id, revision, list(allow_patterns)))
        return str(snap)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    out = convert("someone/tiny-olmoe", tmp_path / "out", quant="q4", revision="v1", progress=False)
    source = PackedModel(out).manifest.source
    assert source["repo"] == "someone/tiny-olmoe" and source["revision"] == commit
    assert source["requested_revision"] == "v1" and set(source["files"]) == {"model.safetensors"}
    assert calls[0][1] == "v1" and "model.safetensors" not in calls[0][2] and "config.json" in calls[0][2]
    assert calls[1][1] == commit and "model.safetensors" in calls[1][2]
