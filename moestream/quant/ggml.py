"""GGUF (ggml) block types as our affine records: which types map exactly, and their codes.

Every ggml type whose blocks are `w = d·q + m` over runs of 32 inputs maps exactly onto the affine
layout (moestream.quant.affine) at group size 32: the codes are the file's own (shifted to be
unsigned), the scale is d and the bias the block's offset. q·scale is exact in float32 (at most 21
significant bits), so `q·scale + bias` rounds once, as gguf's own `d·q − dmin·m` does: the weights
are bit-identical to gguf's dequantization.

  Q8_0  w = d·q, q int8            -> 8-bit, code q + 128, bias −128·d   (scales float16: d is)
  Q4_0  w = d·(q − 8)              -> 4-bit, code q,       bias −8·d     (float16)
  Q4_1  w = d·q + m                -> 4-bit, code q,       bias m        (float16)
  Q5_0  w = d·(q − 16)             -> 8-bit, code q,       bias −16·d    (float16)
  Q5_1  w = d·q + m                -> 8-bit, code q,       bias m        (float16)
  Q4_K  w = d·sc·q − dmin·m        -> 4-bit, per 32: scale d·sc, bias −dmin·m (float32)
  Q5_K  the same with 5-bit codes  -> 8-bit                             (float32)
  MXFP4 w = 2^(e−128)·k, k ∈ ±{0,1,2,3,4,6,8,12} -> 8-bit, code k + 12, bias −12·scale (float32)

The other types (Q6_K and Q2_K/Q3_K, whose scales cover 16 inputs; the IQ types, whose codes index a
grid) have no exact affine form: they are dequantized by gguf and re-quantized at 8 bits, group 32,
never fewer bits or a coarser group than the most the source gives. Float types stay float."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import UnsupportedModelError
from moestream.quant.affine import QuantSpec, pack
from moestream.quant.mxfp4 import scale_values

GROUP = 32
FLOAT_TYPES = ("F32", "F16", "BF16", "F64")
# type -> (bits, block bytes, scale dtype) of the exact affine form
EXACT = {"Q8_0": (8, 34, torch.float16), "Q4_0": (4, 18, torch.float16), "Q4_1": (4, 20, torch.float16),
         "Q5_0": (8, 22, torch.float16), "Q5_1": (8, 24, torch.float16), "Q4_K": (4, 144, torch.float32),
         "Q5_K": (8, 176, torch.float32), "MXFP4": (8, 17, torch.float32)}
REQUANTIZED_BITS = 8  # a type without an exact form: more than any such type's codes
MXFP4_K = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)  # e2m1 values doubled, by code


@dataclass(frozen=True)
class SourcePlan:
    """How convert stores one tensor of a GGUF type by default: `spec` (float where unquantized),
    `kept` when the stored values are the file's exactly (its codes, or its floats)."""

    type_name: str
    spec: QuantSpec
    kept: bool
    scale_dtype: torch.dtype = torch.float32


def plan(type_name: str, shape: tuple[int, ...]) -> SourcePlan:
    """The default storage of a `type_name` tensor of `shape` ([..., out, in])."""
    if type_name in FLOAT_TYPES or len(shape) < 2:
        return SourcePlan(type_name, QuantSpec(), True)
    if type_name in EXACT:
        bits, _, scale_dtype = EXACT[type_name]
        return SourcePlan(type_name, QuantSpec(bits, GROUP), True, scale_dtype)
    return SourcePlan(type_name, QuantSpec(REQUANTIZED_BITS, GROUP), False)


def _half(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of each block, as float32 [..., G]."""
    return blocks[..., at:at + 2].contiguous().view(torch.float16)[..., 0].to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] codes: the n low nibbles, then the n high ones (ggml's order)."""
    return torch.cat((qs & 0x0F, qs >> 4), dim=-1)


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 bytes of 6-bit sub-scales and mins -> sc, m [..., 8] (gguf's get_scale_min)."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mins = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc.to(torch.float32), mins.to(torch.float32)


def _blocks_affine(type_name: str, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks uint8 [..., B, bytes] -> codes int32 [..., B, n], scales and biases float32 [..., B, n/32]."""
    if type_name == "Q8_0":
        d = _half(b, 0)
        return b[..., 2:].contiguous().view(torch.int8).to(torch.int32) + 128, d[..., None], (-128 * d)[..., None]
    if type_name in ("Q4_0", "Q4_1"):
        d = _half(b, 0)
        bias = -8 * d if type_name == "Q4_0" else _half(b, 2)
        return _nibbles(b[..., 2 if type_name == "Q4_0" else 4:]).to(torch.int32), d[..., None], bias[..., None]
    if type_name in ("Q5_0", "Q5_1"):
        d = _half(b, 0)
        bias, at = (-16 * d, 2) if type_name == "Q5_0" else (_half(b, 2), 4)
        qh = b[..., at:at + 4].to(torch.int32)  # bit j of the little-endian word: input j's fifth bit
        high = (qh[..., :, None] >> torch.arange(8, dtype=torch.int32)) & 1  # [..., 4 bytes, 8 bits]
        codes = _nibbles(b[..., at + 4:]).to(torch.int32) | (high.flatten(-2) << 4)
        return codes, d[..., None], bias[..., None]
    if type_name in ("Q4_K", "Q5_K"):
        d, dmin = _half(b, 0), _half(b, 2)
        sc, mins = _k_scales(b[..., 4:16])
        qs = b[..., -128:].unflatten(-1, (4, 32))  # 4 runs of 64 inputs: 32 low nibbles, then 32 high
        codes = _nibbles(qs).flatten(-2).to(torch.int32)  # [..., 256]
        if type_name == "Q5_K":
            qh = b[..., 16:48].to(torch.int32)  # bit j of byte i: input 32·j + i's fifth bit
            codes = codes | ((qh[..., None, :] >> torch.arange(8, dtype=torch.int32)[:, None]) & 1).flatten(-2) << 4
        return codes, d[..., None] * sc, -(dmin[..., None] * mins)
    if type_name == "MXFP4":
        half = scale_values(b[..., 0]) / 2  # ggml's e8m0 "half": 2^(e − 128), exact
        k = torch.tensor(MXFP4_K, dtype=torch.int32)[_nibbles(b[..., 1:]).to(torch.int64)]
        return k + 12, half[..., None], (-12 * half)[..., None]
    raise ValueError(f"no exact affine form for {type_name}")


def affine_parts(type_name: str, raw: torch.Tensor, *, name: str = "") -> dict[str, torch.Tensor]:
    """Rows of a tensor as the file stores them (uint8 [..., O, row bytes]) -> its affine record parts:
    `weight` uint32 [..., O, I·b/32], `scales` and `biases` [..., O, I/32] (EXACT's dtype). `name`
    names the tensor in errors."""
    bits, block_bytes, scale_dtype = EXACT[type_name]
    *lead, rows, width = raw.shape
    if width % block_bytes:
        raise UnsupportedModelError(f"{name}: GGUF {type_name} rows of {width} bytes are not whole {block_bytes}-byte blocks")
    blocks = raw.reshape(-1, width // block_bytes, block_bytes)  # [R, B, bytes]
    codes, scales, biases = _blocks_affine(type_name, blocks)
    n = codes.shape[0]
    weight = pack(codes.reshape(n, -1), bits).reshape(*lead, rows, -1)
    scales, biases = (t.reshape(*lead, rows, -1) for t in (scales, biases))
    if scale_dtype != torch.float32:
        scales, biases = scales.to(scale_dtype), biases.to(scale_dtype)
        if not bool(torch.isfinite(biases).all()):  # a block scale above 511: its bias overflows float16
            raise UnsupportedModelError(f"{name}: GGUF {type_name} block scales above 511, whose biases float16 "
                                        "cannot hold (convert with --quant q8 or none)")
    return {"weight": weight, "scales": scales, "biases": biases}
