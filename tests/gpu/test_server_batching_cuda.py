"""`moestream serve --parallel 4` on CUDA (graphs on, a streamed and a resident cache): 16
concurrent greedy requests each return what the engine gives that prompt alone."""
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def fibonacci(n):", "The quick brown fox", "import os\nclass Thing:", "Hello world! 12",
           "Once upon a time", "x = [1, 2, 3]", "SELECT * FROM", "# Title\n\nSome"]


@pytest.mark.parametrize("cache_size", ["50%", "all"])
def test_concurrent_requests_on_cuda_equal_alone(cache_size, tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16", max_position_embeddings=512)
    flags = ["--device", "cuda", "--dtype", "bfloat16", "--cache-size", cache_size, "--max-context", "256"]
    engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype="bfloat16", cache_size=cache_size,
                                                       max_context=256))
    expected = []
    for i in range(16):
        engine.reset()
        ids = engine.tokenizer.encode(PROMPTS[i % 8])
        gen = engine.generate(ids, max_new_tokens=8 + 3 * i, sampling=SamplingParams())
        expected.append(engine.tokenizer.decode([e.token_id for e in gen]))
    engine.close()

    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "--model", str(packed), "--port", "0",
                             "--parallel", "4", "--max-queue", "32", "--log-level", "warning", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.poll() else "")
        url = line.split("listening on ")[1].split("/v1")[0]
        deadline = time.monotonic() + 300
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)

        def run(i):
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": PROMPTS[i % 8], "max_tokens": 8 + 3 * i, "temperature": 0})
            return r.json()["choices"][0]["text"]

        with ThreadPoolExecutor(16) as pool:
            got = list(pool.map(run, range(16)))
        assert got == expected
        metrics = httpx.get(url + "/metrics").text
        steps = float(next(x for x in metrics.splitlines() if x.startswith("moestream_batch_size_count")).split()[1])
        rows = float(next(x for x in metrics.splitlines() if x.startswith("moestream_batch_size_sum")).split()[1])
        assert rows / steps > 1.5
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
