"""Routed experts computed on the CPU with torch's integer kernels, from MLX-layout records.

Legend: T tokens, H hidden, I expert intermediate, N output rows, K input columns, G group size.

Dequantizing a record and multiplying in torch runs at ~0.3 GB/s of record bytes: far too slow to
help a GPU. torch's int4 CPU kernel (`_weight_int4pack_mm_for_cpu`) reads the 4-bit codes as they
are, so a record is repacked once into its format (a blocked layout that depends on the CPU's
vector width: made by `_convert_weight_to_int4pack_for_cpu`, never by hand) and kept. Its
dequantization is w = (q - 8) * scale + zero, so MLX's w = q * scale + bias becomes
zero = bias + 8 * scale.

8-bit records have no torch kernel with group scales (`_weight_int8pack_mm` takes one scale per
output row), so two ways are kept and measured (docs/bench/cpu_experts_kernels.json):
  - "dequantized": the weights dequantized once into the compute dtype and multiplied with
    F.linear (the reference's own weights; about 1.9x the record's bytes in bf16);
  - "int4x2": the 8-bit code split into two 4-bit halves, q = 16 * hi + lo, each an int4 matrix
    (hi with scale 16s and zero 128s, lo with scale s and zero bias + 8s), summed.
Gate and up are stacked into one matrix, so a token's expert is two kernel calls.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from moestream.quant.affine import QuantSpec, dequantize
from moestream.quant.mxfp4 import MODE as MXFP4

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
INT4_GROUPS = (32, 64, 128, 256)  # group sizes torch's int4 CPU kernel takes
ROWS_MULTIPLE = 16  # its packing needs output rows in multiples of 16
INT8_METHODS = ("dequantized", "int4x2")
DEFAULT_INT8_METHOD = "int4x2"  # 1.9x "dequantized" per token, half its memory (docs/bench/cpu_experts_kernels.json)
COMPUTE_DTYPES = (torch.bfloat16, torch.float32)  # the dtypes the int4 kernel takes (fp16 computes in float32)


def refusal(fields, quant: dict[str, QuantSpec]) -> str | None:
    """Why the CPU kernels cannot compute records of this layout (None: they can)."""
    by_name = {f.name: f for f in fields}
    if any(quant[proj].mode == MXFP4 for proj in PROJECTIONS):
        return "MXFP4 records (the CPU expert kernels take MLX affine 4- and 8-bit records; torch's int4 kernel is affine)"
    if quant["gate_proj"].activation != "silu":
        return f"the CPU expert kernels compute SwiGLU only, not {quant['gate_proj'].activation}"
    for proj in PROJECTIONS:
        spec = quant[proj]
        if not spec.quantized:
            return f"{proj} is not quantized (the CPU expert kernels take 4- and 8-bit records)"
        if spec.bits not in (4, 8):
            return f"{proj}: {spec.bits}-bit codes (the CPU expert kernels take 4 and 8)"
        if spec.group_size not in INT4_GROUPS:
            return f"{proj}: group size {spec.group_size} (torch's int4 CPU kernel takes {INT4_GROUPS})"
        for part in ("weight", "scales", "biases"):
            if f"{proj}.{part}" not in by_name:
                return f"the record has no {proj}.{part}"
        rows = by_name[f"{proj}.weight"].shape[0]
        if rows % ROWS_MULTIPLE:
            return f"{proj}: {rows} output rows, not a multiple of {ROWS_MULTIPLE} (torch's int4 CPU packing)"
    if quant["gate_proj"].bits != quant["up_proj"].bits or quant["gate_proj"].group_size != quant["up_proj"].group_size:
        return "gate_proj and up_proj are quantized differently"
    return None


def _codes(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """MLX uint32 words [N, K*b/32] (least-significant bits first) -> int32 codes [N, K], through
    bytes (a word's bytes in memory order are its low bits first on little-endian CPUs)."""
    raw = weight.contiguous().view(torch.uint8)  # [N, K*b/8]
    if bits == 8:
        return raw.to(torch.int32)
    codes = torch.empty((raw.shape[0], 2 * raw.shape[1]), dtype=torch.int32)  # written once: half the passes
    codes[:, 0::2] = raw & 15
    codes[:, 1::2] = raw >> 4
    return codes


@dataclass
class Int4Matrix:
    """One [N, K] matrix in torch's int4 CPU format."""

    packed: torch.Tensor  # uint8, torch's blocked layout
    scales_zeros: torch.Tensor  # [K/G, N, 2] in the compute dtype
    group: int
    halves: bool = False  # int4x2: the product is [hi part | lo part], to be summed

    @staticmethod
    def of(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, dtype: torch.dtype) -> "Int4Matrix":
        """codes int32 [N, K] in 0..15; scales, zeros float32 [N, K/G] with w = (q - 8) * scale + zero."""
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), 1)
        sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(dtype).contiguous()
        return Int4Matrix(packed, sz, group)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.packed, self.group, self.scales_zeros)
        if self.halves:
            half = y.shape[1] // 2
            y = y[:, :half] + y[:, half:]
        return y

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales_zeros.nbytes


def _int4_of(codes, scales, biases, group: int, dtype) -> Int4Matrix:
    s, b = scales.float(), biases.float()
    return Int4Matrix.of(codes, s, b + 8 * s, group, dtype)


def _int4x2_of(codes, scales, biases, group: int, dtype) -> Int4Matrix:
    """The 8-bit codes as [hi; lo] stacked: rows 0..N-1 give hi's part, N..2N-1 lo's; their sum is the product."""
    s, b = scales.float(), biases.float()
    stacked = torch.cat([codes >> 4, codes & 15])
    m = Int4Matrix.of(stacked, torch.cat([16 * s, s]), torch.cat([128 * s, b + 8 * s]), group, dtype)
    m.halves = True
    return m


@dataclass
class CpuExpert:
    """One expert's weights in the CPU kernels' format: `ffn(x)` is its SwiGLU for rows x [T, H]."""

    gate_up: object  # x [T, H] -> [T, 2I] (gate rows, then up rows): an Int4Matrix or a dense [2I, H] matrix
    down: object  # h [T, I] -> [T, H]
    inter: int  # I
    dtype: torch.dtype

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        gu = self._apply(self.gate_up, x)
        h = F.silu(gu[:, :self.inter]) * gu[:, self.inter:]
        return self._apply(self.down, h)

    def weighted_row_into(self, x: torch.Tensor, out: torch.Tensor, weight: float) -> None:
        """out (float32 [H]) = weight * ffn(x)[0] for one row x [1, H] already in the compute dtype:
        the same bits as `ffn` (the gate activated in place), with no temporaries beyond the
        kernels' own outputs and no conversion of x (the CPU share's per-pair step)."""
        gu = self._apply(self.gate_up, x)
        h = gu[:, :self.inter]
        F.silu(h, inplace=True).mul_(gu[:, self.inter:])
        out.copy_(self._apply(self.down, h)[0])
        out.mul_(weight)

    @staticmethod
    def _apply(matrix, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, matrix) if isinstance(matrix, torch.Tensor) else matrix(x)

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in (self.gate_up, self.down))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return dtype if dtype in COMPUTE_DTYPES else torch.float32


def repacked_nbytes(fields, quant: dict[str, QuantSpec], dtype: torch.dtype, *,
                    int8_method: str = DEFAULT_INT8_METHOD) -> int:
    """The bytes `repack` keeps for one record of this layout (it must have passed `refusal`), known
    before any record is read: the memory ledger counts them. int4: N*K/2 codes and K/G*N (scale,
    zero) pairs; int4x2 twice the rows; "dequantized" N*K weights in the compute dtype."""
    item = torch.finfo(compute_dtype(dtype)).bits // 8
    by_name = {f.name: f for f in fields}
    total = 0
    for projs in (("gate_proj", "up_proj"), ("down_proj",)):
        spec = quant[projs[0]]
        rows = sum(by_name[f"{p}.weight"].shape[0] for p in projs)  # N
        cols = by_name[f"{projs[0]}.weight"].shape[1] * 32 // spec.bits  # K
        if spec.bits == 8 and int8_method == "dequantized":
            total += rows * cols * item
            continue
        if spec.bits == 8:
            rows *= 2  # two int4 halves
        total += rows * cols // 2 + cols // spec.group_size * rows * 2 * item
    return total


def repack(record: dict[str, torch.Tensor], quant: dict[str, QuantSpec], dtype: torch.dtype, *,
           int8_method: str = DEFAULT_INT8_METHOD) -> CpuExpert:
    """An expert's record views (CPU tensors, as decode_record gives them) in the CPU kernels'
    format for activations in `dtype`. The layout must have passed `refusal`."""
    if int8_method not in INT8_METHODS:
        raise ValueError(f"int8 method {int8_method!r} (choose from {', '.join(INT8_METHODS)})")
    dtype = compute_dtype(dtype)
    gspec, dspec = quant["gate_proj"], quant["down_proj"]
    inter = record["gate_proj.weight"].shape[0]

    def matrix(projs: tuple[str, ...], spec: QuantSpec):
        if spec.bits == 8 and int8_method == "dequantized":
            return torch.cat([dequantize(record[f"{p}.weight"], record[f"{p}.scales"], record[f"{p}.biases"],
                                         8, spec.group_size, dtype) for p in projs]).contiguous()
        codes = torch.cat([_codes(record[f"{p}.weight"], spec.bits) for p in projs])
        scales = torch.cat([record[f"{p}.scales"] for p in projs])
        biases = torch.cat([record[f"{p}.biases"] for p in projs])
        make = _int4_of if spec.bits == 4 else _int4x2_of
        return make(codes, scales, biases, spec.group_size, dtype)

    return CpuExpert(matrix(("gate_proj", "up_proj"), gspec), matrix(("down_proj",), dspec), inter, dtype)


__all__ = ["CpuExpert", "Int4Matrix", "refusal", "repack", "repacked_nbytes", "compute_dtype", "INT8_METHODS", "DEFAULT_INT8_METHOD"]
