"""Running a test file's Triton kernels under Triton's CPU interpreter (TRITON_INTERPRET=1).

Triton reads TRITON_INTERPRET when it is first imported, so kernels run interpreted only in a
process started with it. One test of such a file re-runs the whole file in a child process that
is; the file's kernel tests take their module from `interpreted_module` and run only there."""
import importlib
import os
import subprocess
import sys

import pytest

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


def run_file_interpreted(path: str) -> None:
    """The body of the one test that runs `path` again under the interpreter."""
    if INTERPRETED:
        pytest.skip("this process interprets: the tests below run here")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    try:  # below the suite's per-test timeout, so a stuck child is reported with its output
        proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", path],
                              env=env, capture_output=True, text=True, timeout=200)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the interpreted run of {path} took over {exc.timeout} s: {_text(exc.stdout)[-6000:]}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


def _text(output) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else (output or "")


def interpreted_module(name: str):
    """The kernel module `name` as the interpreting child process imports it; skips elsewhere."""
    if not INTERPRETED:
        pytest.skip("runs in the interpreting child process")
    module = importlib.import_module(name)
    assert module._INTERPRETED
    return module


def gen(seed: int):
    """A seeded CPU generator (the kernels' inputs are drawn on the CPU, then moved)."""
    import torch

    return torch.Generator().manual_seed(seed)


def randn(*shape, g, dtype=None):
    """Normal values drawn in float32 with generator g, then cast to dtype."""
    import torch

    return torch.randn(*shape, generator=g).to(dtype or torch.float32)


def relative_error(y, ref) -> float:
    """max |y - ref| / max |ref|, in float64."""
    return ((y.double() - ref.double()).abs().max() / ref.double().abs().max()).item()

