"""Affine group quantization in MLX's layout.

A matrix [O, I] at b bits with group size g is stored as
  weight  uint32 [O, I*b/32]   b-bit codes, least-significant bits first within each word
  scales  [O, I/g]             in the source's float dtype
  biases  [O, I/g]
and w = q * scale + bias, so mlx-community checkpoints import without re-quantizing.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

SUPPORTED_BITS = (2, 4, 8)


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is stored: bits None means unquantized float. `activation` (routed experts'
    projections only) is the gate's activation the record is computed with: "silu" (SwiGLU),
    "gelu_tanh" or "clamped_swiglu" (with its `alpha` and `limit`, and bias tensors in the record);
    it is written to the manifest only where it is not the default. `mode` is how quantized codes
    are read: "affine" (this module's layout) or "mxfp4" (e2m1 codes with a power-of-two scale per
    32 inputs, kept from an MXFP4 source: moestream.quant.mxfp4); written only where not affine."""

    bits: int | None = None
    group_size: int = 64
    activation: str = "silu"
    alpha: float | None = None  # clamped_swiglu: gate * sigmoid(alpha * gate)
    limit: float | None = None  # clamped_swiglu: gate <= limit, |up| <= limit
    mode: str = "affine"

    @property
    def quantized(self) -> bool:
        return self.bits is not None

    def to_json(self) -> dict | None:
        obj = {"bits": self.bits, "group_size": self.group_size} if self.bits else None
        if self.activation != "silu":
            obj = {"bits": self.bits, "group_size": self.group_size, "activation": self.activation}
            obj.update({k: v for k, v in (("alpha", self.alpha), ("limit", self.limit)) if v is not None})
        if self.mode != "affine":
            obj = {**(obj or {"bits": self.bits, "group_size": self.group_size}), "mode": self.mode}
        return obj

    @staticmethod
    def from_json(obj: dict | None) -> "QuantSpec":
        if not obj:
            return QuantSpec()
        return QuantSpec(obj["bits"], obj["group_size"], obj.get("activation", "silu"), obj.get("alpha"), obj.get("limit"),
                         obj.get("mode", "affine"))


def packed_shape(out_features: int, in_features: int, bits: int, group_size: int) -> tuple[tuple, tuple]:
    """Shapes of (weight, scales) for a quantized [out, in] matrix; biases match scales."""
    return (out_features, in_features * bits // 32), (out_features, in_features // group_size)


def can_quantize(shape: tuple[int, ...], group_size: int) -> bool:
    """Only 2-D matrices whose input size is a whole number of groups are quantized."""
    return len(shape) == 2 and shape[1] % group_size == 0 and shape[1] >= group_size


QUANT_BLOCK_ELEMENTS = 1 << 20  # elements quantized at once: ~20 MB of temporaries


def quantize(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[O, I] float -> (uint32 codes [O, I*b/32], scales [O, I/g], biases [O, I/g]) in w's dtype.

    Scales and biases are rounded to their storage dtype before the codes are chosen, so the
    reconstruction error is at most half a step (plus that rounding) for every element. Rows are
    independent, so a big matrix is done in blocks of rows to bound the float32/int64 temporaries."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{bits}-bit quantization is not supported (supported: {', '.join(map(str, SUPPORTED_BITS))})")
    if w.dim() != 2 or w.shape[1] % group_size or w.shape[1] % (32 // bits):
        raise ValueError(f"cannot quantize a {list(w.shape)} tensor with group size {group_size} at {bits} bits")
    out_features, in_features = w.shape
    rows = max(1, QUANT_BLOCK_ELEMENTS // max(in_features, 1))
    if out_features <= rows:
        return _quantize_rows(w, bits, group_size)
    parts = [_quantize_rows(w[start:start + rows], bits, group_size) for start in range(0, out_features, rows)]
    return tuple(torch.cat(p) for p in zip(*parts))


def _quantize_rows(w: torch.Tensor, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    out_features, in_features = w.shape
    levels = (1 << bits) - 1
    groups = w.detach().to(torch.float32).reshape(out_features, in_features // group_size, group_size)
    lo = groups.amin(dim=-1)
    hi = groups.amax(dim=-1)
    scales = ((hi - lo) / levels).clamp_min(1e-8).to(w.dtype)
    biases = lo.to(w.dtype)
    s32, b32 = scales.to(torch.float32), biases.to(torch.float32)
    s32 = torch.where(s32 > 0, s32, torch.ones_like(s32))  # a constant group in fp16 rounds its step to 0
    # Round half up by truncating x + 0.5 (x >= 0 after the clamp); torch.round pays a thread wake-up per call.
    codes = ((groups - b32[..., None]) / s32[..., None]).add_(0.5).clamp_(0, levels).to(torch.int32)
    return pack(codes.reshape(out_features, in_features), bits), scales, biases


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """int codes [O, I] in [0, 2^b) -> uint32 [O, I*b/32], element j of a word at bits j*b."""
    per_word = 32 // bits
    out_features, in_features = codes.shape
    lanes = codes.reshape(out_features, in_features // per_word, per_word)
    packed = lanes[..., 0].to(torch.int64, copy=True)  # accumulated in place: never alias the input
    for j in range(1, per_word):  # one [O, W] lane at a time keeps the int64 temporaries small
        packed |= lanes[..., j].to(torch.int64) << (j * bits)
    return packed.to(torch.uint32)


def unpack(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32/int32 [O, W] -> int32 codes [O, W*32/b]."""
    per_word = 32 // bits
    words = weight.view(torch.int32) if weight.dtype == torch.uint32 else weight
    shifts = torch.arange(per_word, dtype=torch.int32, device=words.device) * bits
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # mask drops sign extension
    return codes.reshape(words.shape[0], -1)


def float_codes(weight: torch.Tensor, bits: int) -> torch.Tensor:
    """uint32/int32 [O, W] -> the codes as float32 [O, W*32/b] (unpack's values, exactly). On the CPU
    4- and 8-bit codes are read through bytes (a word's bytes in memory order hold its codes in
    order on little-endian CPUs): a few operations instead of a shift per code lane."""
    codes = torch.empty(weight.shape[0], weight.shape[1] * 32 // bits, dtype=torch.float32, device=weight.device)
    _codes_into(weight, bits, codes.view(-1))
    return codes


def dequantize(weight: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group_size: int,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w = q * scale + bias, computed in float32, returned as [O, I] in `dtype`. In place in the codes'
    buffer: a large matrix (an embedding) then needs one float32 copy at its peak, not three."""
    codes = float_codes(weight, bits)
    out_features = codes.shape[0]
    grouped = codes.view(out_features, -1, group_size)
    grouped.mul_(scales.to(torch.float32)[..., None]).add_(biases.to(torch.float32)[..., None])
    return codes.to(dtype)


def dequantize_many(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], bits: int, group_size: int,
                    dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """`dequantize` of several (weight, scales, biases) of one bit width and group size at once
    (an expert's gate, up and down): every group's w = q * scale + bias is the same float32
    arithmetic whatever matrix it belongs to, so one multiply and one add serve all of them and
    each result has `dequantize`'s bits. Returns views of one tensor."""
    shapes = [(w.shape[0], w.shape[1] * 32 // bits) for w, _, _ in parts]
    codes = torch.empty(sum(o * i for o, i in shapes), dtype=torch.float32, device=parts[0][0].device)
    at = 0
    for (w, _, _), (o, i) in zip(parts, shapes):
        _codes_into(w, bits, codes[at:at + o * i])
        at += o * i
    scales = torch.cat([s.reshape(-1) for _, s, _ in parts]).to(torch.float32)
    biases = torch.cat([b.reshape(-1) for _, _, b in parts]).to(torch.float32)
    w = codes.view(-1, group_size).mul_(scales[:, None]).add_(biases[:, None]).to(dtype).view(-1)  # in place: one buffer
    out, at = [], 0
    for o, i in shapes:
        out.append(w[at:at + o * i].view(o, i))
        at += o * i
    return out


def _codes_into(weight: torch.Tensor, bits: int, out: torch.Tensor) -> None:
    """float_codes(weight, bits) written into the flat float32 `out`."""
    if weight.device.type != "cpu" or bits not in (4, 8):
        out.copy_(unpack(weight, bits).reshape(-1))
        return
    raw = weight.contiguous().view(torch.uint8).view(-1)  # a word's bytes in memory order hold its codes in order
    if bits == 8:
        out.copy_(raw)
        return
    pairs = out.view(-1, 2)
    pairs[:, 0] = raw & 15
    pairs[:, 1] = raw >> 4
