"""The fused norm kernels (moestream.kernels.triton_decode) under Triton's CPU interpreter
(TRITON_INTERPRET=1), at tiny sizes: they agree with moestream's own torch code (layers/norm.py).

Runs in the interpreter's own stage (tests/interpret/interpreter.py). Skipped where Triton is not
installed. Float32 is checked tightly; bfloat16 only loosely, because the interpreter truncates
float32 -> bfloat16 where the GPU rounds to nearest (tests/gpu checks the bf16 bits)."""

import pytest
import torch

pytest.importorskip("triton")

from interpreter import gen, interpreted_module, randn, relative_error  # noqa: E402

from moestream.layers.norm import rms_norm as torch_rms_norm  # noqa: E402

EPS = 1e-6
TOL = {torch.float32: 1e-5, torch.bfloat16: 3e-2}  # max |y - ref| / max |ref|


@pytest.fixture(scope="module")
def td():
    return interpreted_module("moestream.kernels.triton_decode")


# -- norms ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N", [(1, 64), (5, 200), (3, 256)])
def test_rms_norm(td, T, N, dtype):
    g = gen(N + T)
    big = randn(T, N + 24, g=g, dtype=dtype)
    x = big[:, 8:8 + N]  # strided rows at an offset
    w = randn(N, g=g, dtype=dtype)
    ref = torch_rms_norm(x, w, EPS)
    y = td.rms_norm(x, w, EPS)
    assert y.dtype == dtype and y.shape == (T, N)
    assert relative_error(y, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,N", [(1, 128), (4, 96)])
def test_add_rms_norm(td, T, N, dtype):
    g = gen(N * T)
    x, y, w = randn(T, N, g=g, dtype=dtype), randn(T, N, g=g, dtype=dtype), randn(N, g=g, dtype=dtype)
    h, hn = td.add_rms_norm(x, y, w, EPS)
    if dtype == torch.float32:
        assert torch.equal(h, x + y)
    assert relative_error(h, x + y) < TOL[dtype]
    assert relative_error(hn, torch_rms_norm(x + y, w, EPS)) < TOL[dtype]


def test_bad_arguments_are_refused(td):
    with pytest.raises(ValueError):
        td.rms_norm(torch.zeros(2, 8), torch.zeros(8, dtype=torch.float16), EPS)  # weight dtype
