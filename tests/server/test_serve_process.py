"""`moestream serve` as a process: flags, the key from the environment, SIGTERM (finish within the
grace period, or cancel after it; exit 0 either way), and a model that cannot load (exit 1)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from moestream.commands.serve import api_key_from, build_parser, defaults_from_args

pytestmark = pytest.mark.timeout(120)  # a hung stream fails its test instead of stalling the run

HELPER = Path(__file__).with_name("fake_server.py")
REPO = Path(__file__).resolve().parents[2]


def start(*flags: str, env: dict | None = None) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen([sys.executable, str(HELPER), "--port", "0", "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            env={**os.environ, **(env or {})})
    url = proc.stdout.readline().strip()
    assert url.startswith("http://127.0.0.1:"), (url, proc.stderr.read() if proc.poll() is not None else "")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    proc.kill()
    raise AssertionError("the server did not become ready")


def test_parser_defaults_and_flags():
    parser = build_parser(engine_arguments=False)
    args = parser.parse_args([])
    assert (args.host, args.port, args.max_queue, args.queue_tokens, args.api_key, args.model) == \
        ("127.0.0.1", 8080, None, None, None, None)
    d = defaults_from_args(args)
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens) == (0.2, 64, 0.95, None)
    args = parser.parse_args(["--temperature", "0", "--top-k", "5", "--top-p", "0.5", "--max-tokens", "7",
                              "--max-queue", "0", "--model-id", "m", "--max-context", "99"])
    d = defaults_from_args(args)
    assert (d.temperature, d.top_k, d.top_p, d.max_tokens, args.max_queue, args.model_id, args.max_context) == \
        (0.0, 5, 0.5, 7, 0, "m", 99)
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-queue", "-1"])
    assert parser.parse_args(["--queue-tokens", "5000"]).queue_tokens == 5000
    with pytest.raises(SystemExit):
        parser.parse_args(["--queue-tokens", "0"])
    with pytest.raises(SystemExit):
        defaults_from_args(parser.parse_args(["--temperature", "3"]))


def test_parser_has_the_engine_flags():
    args = build_parser().parse_args(["--model", "m", "--max-context", "512"])
    from moestream.commands.engine_args import options_from_args
    assert options_from_args(args).max_context == 512 and args.model == "m"


def test_api_key_from_flag_or_environment():
    parser = build_parser(engine_arguments=False)
    assert api_key_from(parser.parse_args([]), {}) is None
    assert api_key_from(parser.parse_args([]), {"MOESTREAM_API_KEY": "env-key"}) == "env-key"
    assert api_key_from(parser.parse_args(["--api-key", "flag"]), {"MOESTREAM_API_KEY": "env-key"}) == "flag"


def test_environment_key_protects_a_running_server():
    proc, url = start(env={"MOESTREAM_API_KEY": "from-env"})
    try:
        assert httpx.get(url + "/v1/models").status_code == 401
        assert httpx.get(url + "/v1/models", headers={"Authorization": "Bearer from-env"}).status_code == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0


def read_stream(url: str, body: dict, out: dict) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            out["status"] = r.status_code
            out["events"] = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out["events"].append(line[6:])
                    out.setdefault("first_at", time.monotonic())
    except httpx.HTTPError as exc:
        out["error"] = exc
    out["ended_at"] = time.monotonic()


def test_sigterm_lets_running_requests_finish_and_exits_0():
    proc, url = start("--token-delay", "0.05", "--shutdown-grace", "10")
    out: dict = {}
    reader = threading.Thread(target=read_stream, args=(url, {"prompt": "x", "max_tokens": 30, "stream": True}, out))
    reader.start()
    deadline = time.monotonic() + 10
    while "first_at" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    with pytest.raises(httpx.ConnectError):  # no longer accepting
        httpx.get(url + "/health", timeout=2)
    reader.join(15)
    assert proc.wait(15) == 0
    assert proc.stdout.read().splitlines() == ["engine closed"]  # once, after the last request
    assert out["status"] == 200 and out["events"][-1] == "[DONE]"
    finish = json.loads(out["events"][-2])
    assert finish["choices"][0]["finish_reason"] == "length" and finish["usage"]["completion_tokens"] == 30


def test_sigterm_cancels_work_past_the_grace_period():
    proc, url = start("--token-delay", "0.05", "--shutdown-grace", "1")
    out: dict = {}
    reader = threading.Thread(target=read_stream, args=(url, {"prompt": "x", "max_tokens": 2000, "stream": True}, out))
    reader.start()
    deadline = time.monotonic() + 10
    while "first_at" not in out and time.monotonic() < deadline:
        time.sleep(0.01)
    signalled = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(15) == 0
    exited = time.monotonic() - signalled
    reader.join(5)
    assert exited < 4, exited
    assert proc.stdout.read().splitlines() == ["engine closed"]
    # cancelled just before the grace period ended, with an error event rather than a cut connection
    assert out["events"][-1] == "[DONE]"
    assert json.loads(out["events"][-2])["error"]["code"] == "server_shutdown"


def test_model_that_cannot_load_exits_1():
    proc = subprocess.Popen([sys.executable, str(HELPER), "--port", "0", "--fail-load", "--log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert "the fake model was told not to load" in err


def test_http_side_never_imports_torch():
    code = ("import sys; import moestream.server.app, moestream.server.request_models, moestream.server.worker, "
            "moestream.server.stops, moestream.server.main, moestream.commands.serve; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code], cwd=REPO).returncode == 0
