"""A damaged expert record fails the request that reads it (500, naming the record) and nothing
else: the server goes on serving, and the damaged record is never kept in a slot."""
from __future__ import annotations

import shutil

import httpx
import pytest

from conftest import live_server

Engine = pytest.importorskip("moestream.engine.engine").Engine
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.format.manifest import read_manifest  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def test_a_bad_record_fails_its_request_and_the_server_goes_on(tiny_packed_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_packed_model("qwen3_moe"), model)
    entry = read_manifest(model).expert_layers[0]
    path = model / entry.file
    good = path.read_bytes()
    bad = bytearray(good)
    for expert in range(entry.num_experts):  # every token reads some record of this layer
        bad[expert * entry.record_size + 321] ^= 0x10
    path.write_bytes(bytes(bad))  # the sizes are right, so the model loads; records are checked as read
    body = {"model": "m", "prompt": "def f(x):", "max_tokens": 4, "temperature": 0}
    with live_server(load=lambda: Engine.load(model, options=EngineOptions(device="cpu", cache_size="all")),
                     model_id="m") as server:
        failed = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert failed.status_code == 500, failed.text
        message = failed.json()["error"]["message"]
        assert f"{entry.file}: layer {entry.layer} expert" in message and "is corrupt" in message
        assert "\n" not in message
        assert httpx.get(f"{server.url}/health").json()["status"] == "ok"
        path.write_bytes(good)  # repaired: the same request now reads good records (none was kept)
        again = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
        assert again.status_code == 200, again.text
        assert again.json()["choices"][0]["text"]
