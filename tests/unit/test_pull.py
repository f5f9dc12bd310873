"""`moestream pull` against a local stand-in for the Hub: the same bytes as converting the
downloaded folder, one shard on disk at a time, resumable after a kill, robust to a dropped
connection, and one-line errors offline."""
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hub_repos import shard_checkpoint
from hub_server import HubServer
from moestream.convert import pull as pull_module
from moestream.convert.main import convert
from moestream.convert.pull import DOWNLOAD_DIR, pull
from moestream.errors import MoestreamError

REPO = Path(__file__).resolve().parents[2]
REPO_ID = "tiny-org/tiny-moe"


def file_hashes(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def folder_bytes(folder: Path) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:
                pass  # moved or deleted while we looked
    return total


@pytest.fixture(scope="module")
def sharded(tiny_checkpoint, tmp_path_factory):
    return shard_checkpoint(tiny_checkpoint("qwen3_moe"), tmp_path_factory.mktemp("sharded") / "repo", 4)


@pytest.fixture(scope="module")
def converted(sharded, tmp_path_factory):
    """The reference: `convert` of the very folder the Hub serves."""
    return convert(sharded, tmp_path_factory.mktemp("ref") / "m", quant="q4", progress=False)


@pytest.fixture()
def hub(sharded):
    with HubServer() as server:
        server.state.add_folder(REPO_ID, sharded)
        yield server


def run_cli(hub_url: str, *args, env: dict | None = None, tmp: Path):
    environment = {**os.environ, "HF_ENDPOINT": hub_url, "HF_HOME": str(tmp / "hf-home"), "HF_HUB_DISABLE_TELEMETRY": "1",
                   **(env or {})}
    return subprocess.run([sys.executable, "-m", "moestream", "pull", *map(str, args), "--no-progress"], cwd=REPO,
                          capture_output=True, text=True, timeout=120, env=environment)


def same_model(pulled: Path, converted: Path) -> None:
    """Every file byte-identical; the manifests differ only in where the source came from."""
    a, b = file_hashes(pulled), file_hashes(converted)
    assert sorted(a) == sorted(b)
    assert {k: v for k, v in a.items() if k != "moestream.json"} == {k: v for k, v in b.items() if k != "moestream.json"}
    ma, mb = (json.loads((d / "moestream.json").read_text()) for d in (pulled, converted))
    assert ma.pop("source")["files"] == mb.pop("source")["files"]  # the shards' sha256, as downloaded
    assert ma == mb


def test_the_repo_has_experts_that_straddle_shards(sharded):
    """Otherwise the keep-in-memory path of the pull would go untested."""
    weight_map = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    straddling = [e for e in {n.rsplit(".", 2)[0] for n in weight_map if ".experts." in n}
                  if len({weight_map[f"{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")}) > 1]
    assert straddling


def test_pull_equals_convert_with_one_shard_on_disk(hub, sharded, converted, tmp_path, monkeypatch):
    out = tmp_path / "m"
    download_dir = out / DOWNLOAD_DIR
    after_download, samples, stop = [], [], threading.Event()
    real = pull_module.HubRepo.download

    def download(self, name, folder, *, bar=None):
        path = real(self, name, folder, bar=bar)
        if name.endswith(".safetensors"):  # the metadata files go to the system's temp folder
            after_download.append((name, folder_bytes(download_dir)))
        return path
    monkeypatch.setattr(pull_module.HubRepo, "download", download)

    def sample():  # also catches the partial file while a download runs
        while not stop.is_set():
            samples.append(folder_bytes(download_dir))
            stop.wait(0.0005)
    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        pull(REPO_ID, out, endpoint=hub.url, progress=False)
    finally:
        stop.set()
        sampler.join()
    same_model(out, converted)
    manifest = json.loads((out / "moestream.json").read_text())
    assert manifest["source"]["repo"] == REPO_ID and manifest["source"]["revision"] == hub.state.repos[REPO_ID].commit
    shards = {p.name: p.stat().st_size for p in sharded.glob("*.safetensors")}
    largest = max(shards.values())
    assert [n for n, _ in after_download] == sorted(shards)  # one download per shard, in order
    peak = max(max(size for _, size in after_download), max(samples))
    slack = 4096  # huggingface_hub's small per-file metadata next to the shard
    assert largest <= peak <= largest + slack, (peak, largest)
    for (name, size) in after_download:  # the shard just downloaded, and no earlier one
        assert shards[name] <= size <= shards[name] + slack
    assert not download_dir.exists()


def test_killed_pull_resumes_to_identical_bytes(hub, converted, tmp_path):
    out = tmp_path / "m"
    killed = run_cli(hub.url, REPO_ID, out, "--kill-after-shards", "2", tmp=tmp_path)  # inside the third shard
    assert killed.returncode == 75, killed.stderr
    steps = json.loads((out / "convert-state.json").read_text())["steps"]
    assert not (out / "moestream.json").exists()
    # The first shard is done; the second is not (an expert straddles it and the third, which was cut short).
    assert "shard:model-00001-of-00004.safetensors" in steps and "shard:model-00002-of-00004.safetensors" not in steps
    refused = run_cli(hub.url, REPO_ID, out, tmp=tmp_path)
    assert refused.returncode == 1 and "--resume to continue the unfinished pull" in refused.stderr
    served = len(hub.state.log)
    resumed = run_cli(hub.url, REPO_ID, out, "--resume", tmp=tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert "(verified)" in resumed.stdout
    same_model(out, converted)
    shard_gets = {r.path.rsplit("/", 1)[1] for r in hub.state.log[served:] if r.method == "GET" and r.range is None}
    assert "model-00001-of-00004.safetensors" not in shard_gets  # a finished shard is not downloaded again


def test_dropped_connection_is_resumed(hub, converted, tmp_path, monkeypatch):
    from huggingface_hub import constants

    # Small chunks, so the bytes received before the drop are on disk and the retry asks for the rest.
    monkeypatch.setattr(constants, "DOWNLOAD_CHUNK_SIZE", 16384)
    hub.state.drop_after["model-00002-of-00004.safetensors"] = 100_000
    out = pull(REPO_ID, tmp_path / "m", endpoint=hub.url, progress=False)
    assert "model-00002-of-00004.safetensors" not in hub.state.drop_after  # the fault fired
    resumed = [r.range for r in hub.state.log if r.path.endswith("model-00002-of-00004.safetensors")
               and r.method == "GET" and r.range and not r.range.startswith("bytes=0-")]
    assert resumed and int(resumed[0][len("bytes="):].rstrip("-")) >= 16384
    same_model(out, converted)


def test_dry_run_downloads_no_weights(hub, sharded, tmp_path):
    out = tmp_path / "m"
    result = run_cli(hub.url, REPO_ID, out, "--dry-run", tmp=tmp_path)
    assert result.returncode == 0, result.stderr
    assert not out.exists()
    assert hub.state.weight_gets() == []  # headers only (byte ranges at the start of each shard)
    total = sum(p.stat().st_size for p in sharded.iterdir() if p.is_file())
    for p in sharded.glob("*.safetensors"):
        assert p.name in result.stdout
    assert f"would download {len(list(sharded.iterdir()))} files, {total / 2**20:.2f} MiB" in result.stdout
    real = pull(REPO_ID, tmp_path / "real", endpoint=hub.url, progress=False)
    packed = sum(p.stat().st_size for p in real.iterdir() if p.name != "moestream.json")
    assert f"packed size (q4): {packed / 2**20:.2f} MiB" in result.stdout


@pytest.mark.parametrize("env, message", [
    ({"HF_HUB_OFFLINE": "1"}, "HF_HUB_OFFLINE is set"),
    ({"HF_ENDPOINT": "http://127.0.0.1:9"}, "the Hugging Face Hub cannot be reached"),
])
def test_offline_is_one_line(hub, tmp_path, env, message):
    result = run_cli(hub.url, REPO_ID, tmp_path / "m", env=env, tmp=tmp_path)
    assert result.returncode == 1
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("moestream pull: error: ") and message in lines[0], result.stderr
    assert not (tmp_path / "m").exists()


def test_bad_repo_and_revision(hub, tmp_path):
    with pytest.raises(MoestreamError, match="no such repository"):
        pull("tiny-org/missing", tmp_path / "a", endpoint=hub.url, progress=False)
    with pytest.raises(MoestreamError, match="revision 'v9' not found"):
        pull(REPO_ID, tmp_path / "b", revision="v9", endpoint=hub.url, progress=False)
    with pytest.raises(MoestreamError, match="not a Hub repo id"):
        pull("./folder", tmp_path / "c", endpoint=hub.url, progress=False)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "x").write_text("x")
    with pytest.raises(MoestreamError, match="exists and is not empty"):
        pull(REPO_ID, tmp_path / "d", endpoint=hub.url, progress=False)
    assert [p.name for p in (tmp_path / "d").iterdir()] == ["x"]
