"""MXFP4 (OCP microscaling FP4): gpt-oss's experts as the Hub and GGUF store them, kept bit-exactly.

A weight is `e2m1(code) * 2^(scale - 127)`: a 4-bit e2m1 code (sign, two exponent bits, one
mantissa bit) and one E8M0 scale (a biased power of two) shared by 32 consecutive inputs. Every
such value is exact in bfloat16 and float32. Scale 255 is NaN in the format and is refused.

Sources:
- the Hub (`quant_method: mxfp4`): a stack `X` [E, In, Out] (x @ W) as `X_blocks` (uint8
  [E, Out, In/32, 16]: 32 codes per block, two per byte, the low nibble first) and `X_scales`
  (uint8 [E, Out, In/32]);
- GGUF type MXFP4: 17-byte blocks of 32 inputs, the scale byte first, then 16 bytes whose low
  nibbles are inputs 0..15 and high nibbles inputs 16..31 (`from_ggml` re-orders them to the Hub's).

The record layout (QuantSpec mode "mxfp4", bits 4, group size 32), per [out, in] projection:
  `{proj}.weight`  uint8 [out, in/2]   byte k of a row: input 2k in the low nibble, 2k+1 in the high
  `{proj}.scales`  uint8 [out, in/32]  the E8M0 scale of inputs 32g..32g+31
which is the Hub's blocks of one expert's rows with the block axis flattened: 4.25 bits per weight.
convert keeps these codes by default (`--quant q4|q8|none` dequantizes and re-quantizes instead)."""
from __future__ import annotations

import torch

from moestream.errors import UnsupportedModelError
from moestream.quant.affine import QuantSpec

BLOCKS, SCALES = "_blocks", "_scales"
MODE = "mxfp4"
VALUES_PER_BLOCK = 32
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2
GGML_BLOCK_BYTES = 1 + BYTES_PER_BLOCK  # GGUF: the scale byte, then the codes
NAN_SCALE = 255
BITS_PER_WEIGHT = 4 + 8 / VALUES_PER_BLOCK  # 4.25
# e2m1: sign, two exponent bits, one mantissa bit -> the 16 values of a code
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def spec() -> QuantSpec:
    """The quant spec of a kept MXFP4 projection (the activation is set by convert)."""
    return QuantSpec(4, VALUES_PER_BLOCK, mode=MODE)


def is_mxfp4(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[E, Out, G, 16] blocks -> the [E, G*32, Out] stack they hold."""
    *lead, out, groups, width = blocks_shape
    return (*lead, groups * 2 * width, out)


def check_pair(name: str, blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...],
               blocks_dtype: str = "U8", scales_dtype: str = "U8") -> None:
    if len(blocks_shape) != 4 or blocks_shape[-1] != BYTES_PER_BLOCK or tuple(blocks_shape[:-1]) != tuple(scales_shape):
        raise UnsupportedModelError(f"{name}: MXFP4 blocks {list(blocks_shape)} and scales {list(scales_shape)} are not "
                                    f"[E, Out, G, {BYTES_PER_BLOCK}] and [E, Out, G]")
    if blocks_dtype != "U8" or scales_dtype != "U8":
        raise UnsupportedModelError(f"{name}: MXFP4 blocks and scales must be U8, not {blocks_dtype} and {scales_dtype}")


def check_scales(name: str, scales: torch.Tensor, first: int = 0) -> None:
    """Scale 255 is NaN in E8M0: a corrupt (or not MXFP4) tensor. `first`: the index of scales[0]
    in its stack, so the message names the place in the source."""
    bad = scales == NAN_SCALE
    if bool(bad.any()):
        at = [int(i) for i in torch.nonzero(bad)[0]]
        at[0] += first
        raise UnsupportedModelError(f"{name}: MXFP4 scale 255 (NaN in E8M0) at {at}: the checkpoint is corrupt")


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes -> their float32 values, built from the bits (sign, exponent, mantissa) with
    device ops and no table: no host-to-device copy, so a CUDA graph can capture it."""
    c = codes.to(torch.int32)
    sign, exp, mant = (c >> 3) & 1, (c >> 1) & 3, c & 1
    normal = ((exp + 126) << 23) | (mant << 22)  # (1 + m/2) * 2^(exp - 1) as float32 bits
    subnormal = mant * 0x3F000000  # exponent 0: m * 0.5
    value = torch.where(exp > 0, normal, subnormal).view(torch.float32)
    return torch.where(sign == 1, -value, value)


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes -> 2^(s - 127) in float32, exactly (from the bits: s = 0 is the subnormal 2^-127)."""
    s = scales.to(torch.int32)
    return torch.where(s > 0, s << 23, torch.full_like(s, 0x00400000)).view(torch.float32)


def byte_values(device: torch.device | str = "cpu") -> torch.Tensor:
    """float32 [256, 2]: the values of a byte's low and high nibble (made on the device by device ops)."""
    b = torch.arange(256, dtype=torch.int32, device=device)
    return torch.stack((e2m1_values(b & 0x0F), e2m1_values(b >> 4)), dim=-1)


def _values(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """uint8 bytes [..., G, 16] and scales [..., G] -> float32 [..., G, 32], exact. One gather per
    byte (both its values at once) keeps it near affine dequantization's speed on the CPU."""
    pairs = torch.index_select(byte_values(codes.device), 0, codes.reshape(-1).to(torch.int32))  # [n, 2]
    values = pairs.reshape(*codes.shape[:-1], VALUES_PER_BLOCK)
    return values.mul_(scale_values(scales)[..., None])


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [E, Out, G, 16] uint8, scales [E, Out, G] uint8 -> the stack [E, G*32, Out] in `dtype`."""
    return _values(blocks, scales).flatten(-2).transpose(-1, -2).to(dtype).contiguous()


def record_parts(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One projection's blocks [out, G, 16] and scales [out, G] (the Hub's, of one expert) -> the
    record's `weight` [out, in/2] and `scales` [out, in/32], the same bytes."""
    out, groups, width = blocks.shape
    return blocks.reshape(out, groups * width).contiguous(), scales.contiguous()


def dequantize_matrix(weight: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A record's weight [out, in/2] and scales [out, in/32] (uint8) -> the [out, in] matrix in `dtype`."""
    out, groups = scales.shape
    return _values(weight.reshape(out, groups, BYTES_PER_BLOCK), scales).reshape(out, -1).to(dtype)


def from_ggml(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF MXFP4 rows uint8 [..., G*17] -> the Hub's blocks [..., G, 16] and scales [..., G]:
    the same codes and scales, the nibbles re-paired (ggml: byte j holds inputs j and j+16)."""
    *lead, width = raw.shape
    if width % GGML_BLOCK_BYTES:
        raise UnsupportedModelError(f"GGUF MXFP4 rows of {width} bytes are not whole {GGML_BLOCK_BYTES}-byte blocks")
    blocks = raw.reshape(*lead, width // GGML_BLOCK_BYTES, GGML_BLOCK_BYTES)
    scales, qs = blocks[..., 0], blocks[..., 1:]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., G, 32] in input order
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous(), scales.contiguous()


def record_problem(proj: str, spec: QuantSpec, weight_shape, scales_shape) -> str | None:
    """What is wrong with an MXFP4 projection's record fields (shapes as lists), None if nothing."""
    if spec.bits != 4 or spec.group_size != VALUES_PER_BLOCK:
        return f"{proj}: MXFP4 needs bits 4 and group size {VALUES_PER_BLOCK}, not {spec.bits} and {spec.group_size}"
    if weight_shape is None or scales_shape is None:
        return f"{proj}: an MXFP4 projection needs {proj}.weight and {proj}.scales"
    if (len(weight_shape) != 2 or len(scales_shape) != 2 or weight_shape[0] != scales_shape[0]
            or weight_shape[1] != scales_shape[1] * BYTES_PER_BLOCK):
        return (f"{proj}: MXFP4 weight {list(weight_shape)} and scales {list(scales_shape)} are not "
                f"[out, in/2] and [out, in/{VALUES_PER_BLOCK}]")
    return None
