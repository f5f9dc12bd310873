"""The fused norm kernels (moestream.kernels.triton_decode) on CUDA at Qwen3-30B-A3B sizes: they
give torch's bits up to the float32 summation order, and exactly where the sum is exact."""
import pytest
import torch

pytestmark = pytest.mark.gpu
pytest.importorskip("triton")

from moestream.kernels import triton_decode as td  # noqa: E402
from moestream.layers.norm import rms_norm as torch_rms_norm  # noqa: E402

DEV = "cuda"
H = 2048
EPS = 1e-6
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def gen(seed):
    return torch.Generator(device=DEV).manual_seed(seed)


def randn(*shape, g, dtype=torch.float32):
    return torch.randn(*shape, generator=g, device=DEV).to(dtype)


def ulps(a, b):
    """|a - b| in units in the last place of the dtype, elementwise (int64)."""
    bits, mag = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
                 torch.float32: (torch.int32, 0x7FFFFFFF)}[a.dtype]

    def ordered(t):
        i = t.contiguous().view(bits).to(torch.int64)
        return torch.where(i < 0, -(i & mag), i & mag)

    return (ordered(a) - ordered(b)).abs()


def assert_torch_bits_up_to_sum_order(y, ref):
    # A different float32 sum can move rstd by an ulp or two; that rarely changes a rounded x*rstd
    # (by one ulp), and the weight multiply can spread that to two.
    d = ulps(y, ref)
    assert d.max() <= (8 if y.dtype == torch.float32 else 2), d.max()
    if y.dtype != torch.float32:
        assert (d == 0).float().mean() >= 0.999


# -- norms ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("T", [1, 7, 32])
def test_rms_norm_and_add_rms_norm(T, dtype):
    dtype = DTYPES[dtype]
    g = gen(T)
    x, y = randn(T, H, g=g, dtype=dtype), randn(T, H, g=g, dtype=dtype)
    w = (1 + randn(H, g=g) / 4).to(dtype)
    assert_torch_bits_up_to_sum_order(td.rms_norm(x, w, EPS), torch_rms_norm(x, w, EPS))
    h, hn = td.add_rms_norm(x, y, w, EPS)
    assert torch.equal(h, x + y)
    assert_torch_bits_up_to_sum_order(hn, torch_rms_norm(x + y, w, EPS))


@pytest.mark.parametrize("dtype", ["bf16", "fp16", "fp32"])
def test_rms_norm_is_torch_bits_when_the_sum_is_exact(dtype):
    """Inputs k/8 with small k: every partial sum of squares is exact in float32, so the summation
    order cannot matter and the kernels must give torch's bits exactly (rsqrt included)."""
    dtype = DTYPES[dtype]
    g = gen(1)
    x = (torch.randint(-24, 25, (5, H), generator=g, device=DEV) / 8).to(dtype)
    y = (torch.randint(-24, 25, (5, H), generator=g, device=DEV) / 8).to(dtype)
    w = (1 + randn(H, g=g) / 4).to(dtype)
    assert torch.equal(td.rms_norm(x, w, EPS), torch_rms_norm(x, w, EPS))
    h, hn = td.add_rms_norm(x, y, w, EPS)
    assert torch.equal(h, x + y) and torch.equal(hn, torch_rms_norm(x + y, w, EPS))
