"""The row tile's product kernel (moestream.kernels.triton_rows) compiles for an H100/H200 (sm_90) on a
machine without a GPU, with the block sizes the defaults and the sweep of scripts/bench_kernels.py
use: bf16 products on the tensor cores (Hopper's wgmma with the weights on the M side, mma.sync
otherwise) with their loads pipelined, float32 ones in IEEE float32. The interpreter runs Python, so it accepts code the compiler
may refuse; this catches that before a GPU run. Skipped where Triton or its NVIDIA backend is missing."""
import pytest
import torch

triton = pytest.importorskip("triton")
pytest.importorskip("triton.backends.nvidia")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moestream.kernels import triton_rows as tr  # noqa: E402
from moestream.kernels.expert_layout import KernelConfig  # noqa: E402


def ptx(N: int, K: int, dtype: torch.dtype, config: KernelConfig, *, bias: bool = False, pdl: bool = False) -> str:
    settings = tr.tile(N, K, dtype, config)
    warps, stages = settings.pop("num_warps"), settings.pop("num_stages")
    constants = dict(settings, K=K, RB=16, HAS_BIAS=bias, PRECISION="ieee" if dtype == torch.float32 else "tf32",
                     DOT_F32=False, PDL=pdl)
    t = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    names = tr._tile_linear_kernel.arg_names
    pointers = {"part_ptr": "*fp32", "counters_ptr": "*i32"}  # a split's partials and its column blocks' counters
    signature = {name: "constexpr" if name in constants else pointers.get(name, "*" + t) if name.endswith("_ptr")
                 else "i32" for name in names}
    # as a launch specializes them: pointers 16-byte aligned, row strides multiples of 16 elements
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n.endswith("_ptr") or n.startswith("stride")}
    compiled = triton.compile(ASTSource(tr._tile_linear_kernel, signature, constants, aligned),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    return compiled.asm["ptx"]


@pytest.mark.parametrize("N,K", [(5120, 2048), (2048, 4096), (128, 2048), (333, 1000)])
def test_the_default_tiles_compile_on_the_tensor_cores(N, K):
    cfg = KernelConfig()
    settings = tr.tile(N, K, torch.bfloat16, cfg)
    code = ptx(N, K, torch.bfloat16, cfg, bias=N == 333)
    assert ".target sm_90" in code and ("wgmma.mma_async" if settings["SWAP"] and settings["BN"] >= 64 else "mma.sync") in code
    if K // settings["SPLIT"] > settings["BK"]:  # the loads pipelined: 16-byte asynchronous copies to shared memory
        assert "cp.async.cg.shared.global" in code
    if settings["SPLIT"] > 1:
        assert "atom" in code


@pytest.mark.parametrize("n,k,warps,stages", [(16, 128, 4, 3), (32, 256, 2, 5), (32, 512, 4, 3), (16, 256, 1, 4)])
def test_the_sweeps_tiles_compile(n, k, warps, stages):
    wide = KernelConfig(rows_n=n, rows_k=k, rows_warps=warps, rows_stages=stages, rows_swap=0, rows_split=1)
    assert "mma.sync" in ptx(5120, 2048, torch.bfloat16, wide)
    deep = KernelConfig(rows_deep_n=n, rows_deep_k=k, rows_deep_warps=warps, rows_deep_stages=stages, rows_deep_split=2)
    assert "mma.sync" in ptx(2048, 4096, torch.bfloat16, deep)
    narrow = KernelConfig(rows_narrow_n=n, rows_narrow_k=2 * k, rows_narrow_warps=warps, rows_narrow_stages=stages - 1,
                          rows_narrow_split=1)
    assert "mma.sync" in ptx(128, 2048, torch.bfloat16, narrow)


@pytest.mark.parametrize("N,K,split", [(2048, 4096, 4), (5120, 2048, 2), (128, 2048, 4)])
def test_a_split_product_compiles_with_its_counter(N, K, split):
    cfg = KernelConfig(rows_split=split, rows_narrow_split=split, rows_deep_split=split, rows_swap=0, rows_n=16)
    assert tr.tile(N, K, torch.bfloat16, cfg)["SPLIT"] == split
    code = ptx(N, K, torch.bfloat16, cfg)
    assert "mma.sync" in code and "atom" in code
    if K // split > 512:  # several steps of K per split: their loads pipelined
        assert "cp.async.cg.shared.global" in code


def test_weights_on_the_m_side_take_hopper_wgmma():
    cfg = KernelConfig(rows_n=64, rows_k=256, rows_warps=4, rows_swap=1, rows_deep_n=64, rows_deep_warps=4,
                       rows_deep_swap=1, rows_deep_split=4)
    assert "wgmma.mma_async" in ptx(5120, 2048, torch.bfloat16, cfg)
    assert "wgmma.mma_async" in ptx(2048, 4096, torch.bfloat16, cfg)  # with a split too


def test_float32_products_stay_ieee():
    code = ptx(333, 1000, torch.float32, KernelConfig(), bias=True)
    assert ".target sm_90" in code and "mma" not in code and "fma.rn.f32" in code


def test_a_pdl_launch_waits_for_the_kernel_before_it():
    assert "griddepcontrol.wait" in ptx(2048, 4096, torch.bfloat16, KernelConfig(), pdl=True)
    assert "griddepcontrol" not in ptx(2048, 4096, torch.bfloat16, KernelConfig())
