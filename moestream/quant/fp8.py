"""Block-scaled FP8 source checkpoints (DeepSeek-V3, Qwen3-*-FP8, MiniMax-M2 as the Hub stores them).

config.json says `"quantization_config": {"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}`. A quantized matrix is stored as
`X.weight` (float8 e4m3, [..., R, C]) beside `X.weight_scale_inv` ([..., ceil(R/bm), ceil(C/bn)],
float32; E8M0 exponent bytes in some files): the weight is `q * scale_inv` of its block, the product
taken in float32 as transformers' fine-grained FP8 dequantization takes it. Edge blocks may be
partial (DeepSeek's 576-row latent projection); convert re-quantizes the float32 products."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.errors import UnsupportedModelError

FP8_DTYPES = ("F8_E4M3",)  # the weight dtype a scaled matrix is stored in
SCALE_SUFFIX = "_scale_inv"  # `X.weight` -> `X.weight_scale_inv` (a stack `X` -> `X_scale_inv`)
E4M3_NAMES = ("e4m3", "float8_e4m3fn")  # how config.json files spell the format


@dataclass(frozen=True)
class Fp8Quantization:
    block: tuple[int, int]  # rows, columns of one scale's block

    @staticmethod
    def from_config(config: dict) -> "Fp8Quantization | None":
        """The checkpoint's block-scaled FP8 settings, or None where it is not an FP8 checkpoint."""
        q = config.get("quantization_config")
        if not isinstance(q, dict) or q.get("quant_method") != "fp8":
            return None
        where = "config.json: quantization_config"
        if q.get("fmt", "e4m3") not in E4M3_NAMES:
            raise UnsupportedModelError(f"{where}.fmt {q['fmt']!r} is not supported (only e4m3)")
        if q.get("activation_scheme", "dynamic") != "dynamic":
            raise UnsupportedModelError(f"{where}.activation_scheme {q['activation_scheme']!r} is not supported "
                                        "(only dynamic: weights scaled, activations not)")
        block = q.get("weight_block_size")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise UnsupportedModelError(f"{where}.weight_block_size must be two positive integers, not {block!r}")
        return Fp8Quantization((block[0], block[1]))

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The scale grid of a weight of `shape` ([..., R, C])."""
        (bm, bn), (R, C) = self.block, shape[-2:]
        return (*shape[:-2], -(-R // bm), -(-C // bn))


def scale_values(scale_inv: torch.Tensor) -> torch.Tensor:
    """The scales in float32 (E8M0 bytes are powers of two: 2^(byte - 127))."""
    if scale_inv.dtype == torch.uint8:
        return (scale_inv.to(torch.float32) - 127.0).exp2()
    return scale_inv.to(torch.float32)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], *, first_row: int = 0) -> torch.Tensor:
    """q [..., R, C] (float8) times its block's scale, in float32. `scale_inv` is the whole grid
    of the matrix ([..., ceil(rows/bm), ceil(C/bn)]) and q its rows first_row.. (a slice read
    on its own)."""
    bm, bn = block
    R, C = q.shape[-2:]
    rows = torch.arange(first_row, first_row + R) // bm  # each row's scale row
    s = scale_values(scale_inv)[..., rows, :].repeat_interleave(bn, dim=-1)[..., :C]  # [..., R, C]
    return q.to(torch.float32) * s
