"""Torch reference ops over expert records: dequantize, then the SwiGLU expert FFN.

The Triton kernels must agree with these; on CPU these are the kernels."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec, dequantize

# the gated activations a record's experts may use (QuantSpec.activation), and those whose records
# also hold the projections' added biases: gate_proj.bias, up_proj.bias, down_proj.bias
GATE_ACTIVATIONS = ("silu", "gelu_tanh", "clamped_swiglu")
BIASED_ACTIVATIONS = ("clamped_swiglu",)


# The CPU's vectorized loop for an elementwise function (sigmoid, silu, tanh, exp) computes a
# tensor's last values, past a multiple of its vector chunk, with the scalar function, which may round
# otherwise: a row's bits would depend on how many rows come before it. Padded to this many values a
# row, every value takes the vector path whatever the rows.
ROW_PAD = 64


def rowwise(fn, x: torch.Tensor) -> torch.Tensor:
    """fn(x) for an elementwise fn over rows x [..., n], each row's bits as it gets alone (CPU)."""
    n = x.shape[-1]
    if x.is_cuda or n % ROW_PAD == 0:
        return fn(x)
    return fn(F.pad(x, (0, -n % ROW_PAD)))[..., :n]


def swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, *, linear=F.linear
           ) -> torch.Tensor:
    """down(silu(gate x) * up x); x [T, H], gate/up [I, H], down [H, I]; linear: the products' kernel."""
    return linear(rowwise(F.silu, linear(x, gate)) * linear(x, up), down)


# A row of torch.bmm over [n, 1, K] rows against one stored matrix is the very BLAS call F.linear
# makes for that row alone (one-row gemm per batch item; measured equal on MKL for every shape tried,
# tests/unit/test_rows_exact.py). torch computes products under 400 multiply-adds with its own loop,
# and bf16/fp16 through oneDNN, so there the rows are computed one by one. Another BLAS may batch
# otherwise, so each shape is also checked once on this machine (PROBE_LIMIT: the largest matrix
# checked; a larger one, a big vocabulary's head, runs row by row).
SMALL_PRODUCT = 400
PROBE_LIMIT = 1 << 24  # elements (64 MB of float32)


def rows_exact(dtype: torch.dtype, inputs: int, outputs: int) -> bool:
    """Whether `rows_linear` gives each row F.linear's bits for that row alone (CPU, this dtype and shape,
    with this process's thread count)."""
    return dtype == torch.float32 and SMALL_PRODUCT <= inputs * outputs <= PROBE_LIMIT and \
        _rows_agree(inputs, outputs, torch.get_num_threads())


@functools.lru_cache(maxsize=None)
def _rows_agree(inputs: int, outputs: int, threads: int) -> bool:
    """rows_linear against F.linear row by row on random float32 rows (side by side and strided), once
    per shape and thread count."""
    g = torch.Generator().manual_seed(inputs * 7919 + outputs)
    weight = torch.randn(outputs, inputs, generator=g)
    x = torch.randn(6, inputs, generator=g)
    for rows in (x[:3], x[::2]):
        alone = torch.cat([F.linear(rows[i:i + 1], weight) for i in range(rows.shape[0])])
        if not torch.equal(rows_linear(rows, weight).view(rows.shape[0], outputs), alone):
            return False
    return True


def rows_linear(x: torch.Tensor, weight: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, K] @ weight [N, K]^T -> [n, 1, N] with, row by row, the bits of F.linear(x[i:i+1], weight)
    (where `rows_exact`): a step's rows share one call but never each other's rounding."""
    n, K = x.shape
    if n == 1:  # F.linear's own call (mm), without the batched call's overhead
        y = torch.mm(x, weight.t(), out=None if out is None else out.view(1, -1))
        return y.view(1, 1, -1)
    return torch.bmm(x.unsqueeze(1), weight.t().expand(n, K, weight.shape[0]), out=out)


def projection(tensors: dict[str, torch.Tensor], proj: str, spec: QuantSpec, dtype: torch.dtype) -> torch.Tensor:
    """One projection of a record as a float [out, in] matrix in `dtype`."""
    if spec.mode == mxfp4.MODE:  # exact: every e2m1 value times a power of two
        return mxfp4.dequantize_matrix(tensors[f"{proj}.weight"], tensors[f"{proj}.scales"], dtype)
    if spec.quantized:
        return dequantize(tensors[f"{proj}.weight"], tensors[f"{proj}.scales"], tensors[f"{proj}.biases"],
                          spec.bits, spec.group_size, dtype)
    return tensors[f"{proj}.weight"].to(dtype)


def expert_ffn(x: torch.Tensor, tensors: dict[str, torch.Tensor], quant: dict[str, QuantSpec]) -> torch.Tensor:
    """x [T, H] through one expert's SwiGLU, weights taken from its record views."""
    g, u, d = (projection(tensors, p, quant[p], x.dtype) for p in ("gate_proj", "up_proj", "down_proj"))
    return swiglu(x, g, u, d)


def int8_rounded(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (float32) as the native int8 rows multiply it (moestream/cpu_share/native/int8_rows.h):
    per 32 inputs q = round(x * 127 / max|x|), back as q * max|x| / 127; their products then differ
    from the dequantized weights' with these inputs only in float32 rounding."""
    groups = x.reshape(*x.shape[:-1], -1, 32)
    amax = groups.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    q = torch.round((groups * inv).clamp(-127, 127))
    return (q * (amax / 127.0)).reshape(x.shape)
