"""The expert kernels' GELU-tanh and clamped-SwiGLU variants, and their MXFP4 variants, compile for an
H100/H200 (sm_90) on a machine without a GPU: Triton's NVIDIA backend lowers them to PTX and its bundled ptxas assembles
them. The interpreter runs Python, so it accepts code the compiler may refuse; this catches that
before a GPU run. Skipped where Triton or its NVIDIA backend is missing."""
import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moestream.kernels import triton_moe as tm  # noqa: E402

H, I, A, BITS = 128, 192, 2, 4
# pointer arguments' element types; X marks the activations' dtype, B the added biases'
POINTERS = {"xs_ptr": "fp32", "hs_ptr": "fp32", "x_ptr": "X", "h_ptr": "H", "rw_ptr": "X", "ids_ptr": "i64",
            "slot_table_ptr": "i32", "pool_w": "i32", "pool_s": "bf16", "pool_b": "B", "o_ptr": "fp32",
            "block_rank_ptr": "i64", "starts_ptr": "i64", "counts_ptr": "i64", "block_start_ptr": "i64",
            "order_ptr": "i64"}


def compile_for_sm90(kernel, constants: dict, *, x: str, h: str, bias: str, scales: str = "bf16") -> str:
    """The kernel's PTX for sm_90 with these compile-time arguments (every other argument an i32, fp32
    for alpha and limit, or a pointer; the pool read as `scales`: bf16 halves, or u8 bytes for MXFP4)."""
    types = {"X": x, "H": h, "B": bias, "bf16": scales}
    if "PDL" in kernel.arg_names:  # launched without programmatic dependent launch unless asked
        constants = {"PDL": False, **constants}
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in POINTERS:
            signature[name] = "*" + types.get(POINTERS[name], POINTERS[name])
        else:
            signature[name] = "fp32" if name in ("alpha", "limit") else "i32"
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": 4})
    return compiled.asm["ptx"]


def all_four(act: str, bias: str | None, x: str, *, mx: bool) -> list[str]:
    """The PTX of the gemv and grouped gate/up and down kernels for one variant."""
    has_bias, x_dtype = bias is not None, {"bf16": tl.bfloat16, "fp32": tl.float32}[x]
    gemv = dict(H=H, I=I, BITS=BITS, BN=16, NG=16 if mx else 4, HAS_BIAS=has_bias, X_DTYPE=x_dtype, MX=mx)
    grouped = dict(H=H, I=I, BITS=BITS, BM=16, BN=64, PRECISION="tf32x3" if x == "fp32" else "tf32", DOT_F32=False,
                   HAS_BIAS=has_bias, MX=mx)
    kinds = dict(x=x, bias=bias or "bf16", scales="u8" if mx else "bf16")
    return [compile_for_sm90(tm._gate_up_gemv, dict(gemv, A=A, H_CPW=8, ACT=act), h="fp32", **kinds),
            compile_for_sm90(tm._down_gemv, gemv, h="fp32", **kinds),
            compile_for_sm90(tm._gate_up_grouped, dict(grouped, A=A, ACT=act), h=x, **kinds),
            compile_for_sm90(tm._down_grouped, grouped, h=x, **kinds)]


@pytest.mark.parametrize("act,bias", [("gelu_tanh", None), ("clamped_swiglu", "bf16"), ("clamped_swiglu", "fp32")])
@pytest.mark.parametrize("x", ["bf16", "fp32"])
def test_activation_variants_compile_for_sm90(act, bias, x):
    ptx = all_four(act, bias, x, mx=False)
    assert all(".target sm_90" in p for p in ptx)
    assert all("ex2.approx" in p for p in ptx[::2])  # the gate's exp (sigmoid) is in the gate/up kernels


@pytest.mark.parametrize("act,bias", [("silu", None), ("clamped_swiglu", "bf16"), ("clamped_swiglu", "fp32")])
@pytest.mark.parametrize("x", ["bf16", "fp32"])
def test_mxfp4_variants_compile_for_sm90(act, bias, x):
    """MXFP4 records (gpt-oss's, with its clamped SwiGLU and biases; SwiGLU too): the scales are read
    as bytes, and every kernel is another program than its affine variant."""
    ptx = all_four(act, bias, x, mx=True)
    assert all(".target sm_90" in p for p in ptx)
    assert all("ex2.approx" in p for p in ptx[::2])
    assert all(a != b for a, b in zip(ptx, all_four(act, bias, x, mx=False)))


@pytest.mark.parametrize("mx", [False, True])
def test_the_grouped_product_takes_hopper_wgmma(mx):
    """With the weight rows on the product's M side, the grouped kernels' products are Hopper's wgmma
    (the dequantized weights fed from registers) even for 16 pairs per tile, where x W^T took the older
    mma.sync."""
    assert all("wgmma.mma_async" in p for p in all_four("silu", None, "bf16", mx=mx)[2:])


def test_a_pdl_launch_waits_for_the_kernel_before_it():
    """moestream.kernels.pdl: a kernel launched with PDL starts with griddepcontrol.wait; without, none."""
    gemv = dict(H=H, I=I, BITS=BITS, BN=16, NG=4, HAS_BIAS=False, X_DTYPE=tl.bfloat16, MX=False)
    kinds = dict(x="bf16", bias="bf16", scales="bf16", h="fp32")
    assert "griddepcontrol.wait" in compile_for_sm90(tm._down_gemv, dict(gemv, PDL=True), **kinds)
    assert "griddepcontrol" not in compile_for_sm90(tm._down_gemv, gemv, **kinds)
