"""`python -m moestream serve` as a child process, ready to take requests."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[2]


def start_serve(*flags: str, ready_s: float = 60) -> tuple[subprocess.Popen, str]:
    """Start `moestream serve --port 0 FLAGS...`; returns the process and its base URL once /health is 200."""
    proc = subprocess.Popen([sys.executable, "-m", "moestream", "serve", "--port", "0", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert "listening on http://127.0.0.1:" in line, line + (proc.stderr.read() if proc.poll() else "")
        url = line.split("listening on ")[1].split("/v1")[0]
        deadline = time.monotonic() + ready_s
        while httpx.get(url + "/health").status_code != 200:
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.1)
    except BaseException:  # a server that never got ready is not left behind
        proc.kill()
        proc.wait(10)
        raise
    return proc, url
