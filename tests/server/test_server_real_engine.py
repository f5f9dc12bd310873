"""End to end on the real engine and a tiny packed model: the server really started, the official
openai SDK as the client, and the engine's own output as the reference."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import live_server

pytest.importorskip("torch")
Engine = pytest.importorskip("moestream.engine.engine").Engine
from moestream.engine.options import EngineOptions  # noqa: E402
from moestream.engine.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

REPO = Path(__file__).resolve().parents[2]
MODEL_ID = "tiny-moe"
CHAT = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello world! naïve café"}]


@pytest.fixture(scope="module")
def model_dir(tiny_packed_model):
    return tiny_packed_model("qwen3_moe")


@pytest.fixture(scope="module")
def reference_engine(model_dir):
    return Engine.load(model_dir, options=EngineOptions(device="cpu"))


@pytest.fixture(scope="module")
def real(model_dir):
    with live_server(load=lambda: Engine.load(model_dir, options=EngineOptions(device="cpu")),
                     model_id=MODEL_ID) as s:
        yield s


def engine_text(engine, prompt_ids, max_new, sampling) -> str:
    gen = engine.generate(prompt_ids, max_new_tokens=max_new, sampling=sampling)
    ids = [ev.token_id for ev in gen]
    return engine.tokenizer.decode(ids)


def test_chat_stream_equals_whole_equals_engine(sdk, reference_engine):
    whole = sdk.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24)
    chunks = list(sdk.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=24,
                                              stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    ids = reference_engine.tokenizer.chat_ids(CHAT)
    expected = engine_text(reference_engine, ids, 24, SamplingParams(temperature=0.0))
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == len(ids)


def test_completion_text_and_token_ids(sdk, reference_engine):
    prompt = "def fibonacci(n):"
    whole = sdk.completions.create(model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=20)
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL_ID, prompt=prompt, temperature=0, max_tokens=20, stream=True) if c.choices)
    assert streamed == whole.choices[0].text
    ids = reference_engine.tokenizer.encode(prompt)
    by_ids = sdk.completions.create(model=MODEL_ID, prompt=ids, temperature=0, max_tokens=20)
    assert by_ids.choices[0].text == whole.choices[0].text
    assert whole.choices[0].text == engine_text(reference_engine, ids, 20, SamplingParams())


def test_seeded_sampling_is_reproducible(sdk, reference_engine):
    kw = dict(model=MODEL_ID, messages=CHAT, temperature=0.9, top_p=0.95, max_tokens=24,
              extra_body={"top_k": 50})
    a = sdk.chat.completions.create(seed=11, **kw).choices[0].message.content
    b = sdk.chat.completions.create(seed=11, **kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in sdk.chat.completions.create(stream=True, seed=11, **kw)
                       if c.choices)
    assert a == b == streamed
    sampling = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=11)
    assert a == engine_text(reference_engine, reference_engine.tokenizer.chat_ids(CHAT), 24, sampling)


def test_stop_string_on_real_text(sdk):
    whole = sdk.completions.create(model=MODEL_ID, prompt="The quick", temperature=0, max_tokens=30).choices[0].text
    assert len(whole) >= 8, "the deterministic tiny model should write at least 8 characters here"
    stop = whole[4:7]
    cut = whole[: whole.index(stop)]
    r = sdk.completions.create(model=MODEL_ID, prompt="The quick", temperature=0, max_tokens=30, stop=[stop])
    streamed = "".join(c.choices[0].text for c in sdk.completions.create(
        model=MODEL_ID, prompt="The quick", temperature=0, max_tokens=30, stop=[stop], stream=True) if c.choices)
    assert r.choices[0].text == streamed == cut and r.choices[0].finish_reason == "stop"


def test_prefix_reuse_on_the_real_kv_cache(sdk):
    first = sdk.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=8)
    history = CHAT + [{"role": "assistant", "content": first.choices[0].message.content},
                      {"role": "user", "content": "More please."}]
    second = sdk.chat.completions.create(model=MODEL_ID, messages=history, temperature=0, max_tokens=4)
    t = second.model_extra["timings"]
    assert t["reused_tokens"] >= first.usage.prompt_tokens
    assert t["prefill_tokens"] == second.usage.prompt_tokens - t["reused_tokens"]
    assert second.usage.prompt_tokens_details.cached_tokens == t["reused_tokens"]


def test_health_and_logprobs(real, sdk):
    health = httpx.get(real.url + "/health").json()
    assert health["status"] == "ok" and health["stats"]["family"] == "qwen3_moe"
    r = sdk.chat.completions.create(model=MODEL_ID, messages=CHAT, temperature=0, max_tokens=5, logprobs=True,
                                    top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob for t in content)


def test_moestream_serve_process(model_dir):
    """`python -m moestream serve` itself: ready, answers, stops on SIGTERM with exit 0."""
    env = {**os.environ, "MOESTREAM_API_KEY": "k"}
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "--model", str(model_dir), "--port", "0",
                             "--device", "cpu", "--max-context", "128", "--log-level", "warning"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.poll() else "")
        url = line.split("listening on ")[1].split("/v1")[0]
        deadline = time.monotonic() + 60
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
        headers = {"Authorization": "Bearer k"}
        models = httpx.get(url + "/v1/models", headers=headers).json()
        assert models["data"][0]["id"] == Path(model_dir).name and models["data"][0]["max_context"] == 128
        r = httpx.post(url + "/v1/completions", headers=headers,
                       json={"prompt": "x" * 200, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
        r = httpx.post(url + "/v1/chat/completions", headers=headers,
                       json={"messages": CHAT, "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_text_to_a_model_without_tokenizer_is_a_400_and_token_ids_work(model_dir, tmp_path):
    """A synthetic model (no tokenizer files) serves token-id prompts; text is refused with a 400
    that says what to send, never a 500."""
    import json
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(model_dir, bare)
    manifest = json.loads((bare / "moestream.json").read_text())
    for name in [n for n in manifest["files"] if n.startswith("tokenizer") or "chat_template" in n]:
        del manifest["files"][name]
        (bare / name).unlink()
    (bare / "moestream.json").write_text(json.dumps(manifest))
    with live_server(load=lambda: Engine.load(bare, options=EngineOptions(device="cpu")), model_id=MODEL_ID) as s:
        with httpx.Client(base_url=s.url, timeout=30) as http:
            text = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": "hello", "max_tokens": 2})
            assert text.status_code == 400, text.text
            assert text.json()["error"]["code"] == "no_tokenizer"
            chat = http.post("/v1/chat/completions", json={"model": MODEL_ID, "max_tokens": 2,
                                                           "messages": [{"role": "user", "content": "hi"}]})
            assert chat.status_code == 400 and "no tokenizer" in chat.json()["error"]["message"], chat.text
            ids = http.post("/v1/completions", json={"model": MODEL_ID, "prompt": [5, 6, 7], "max_tokens": 3,
                                                     "temperature": 0})
            assert ids.status_code == 200, ids.text
            assert ids.json()["usage"]["completion_tokens"] == 3
