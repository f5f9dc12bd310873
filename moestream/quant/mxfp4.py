"""MXFP4 source checkpoints (gpt-oss's experts as the Hub stores them, `quant_method: mxfp4`).

A stack `X` [E, In, Out] (x @ W) is stored as `X_blocks` (uint8 [E, Out, In/32, 16]: 32 e2m1
codes per block, two per byte, the low nibble first) and `X_scales` (uint8 [E, Out, In/32]: the
block's shared E8M0 exponent). A weight is `e2m1(code) * 2^(scale - 127)` (the OCP microscaling
format); every such value is exact in bfloat16. Convert re-quantizes the dequantized stacks to
--quant (the MXFP4 bits are not kept as they are)."""
from __future__ import annotations

import torch

from moestream.errors import UnsupportedModelError

BLOCKS, SCALES = "_blocks", "_scales"
VALUES_PER_BLOCK = 32
# e2m1: sign, two exponent bits, one mantissa bit -> the 16 values of a code
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def is_mxfp4(config: dict) -> bool:
    q = config.get("quantization_config")
    return isinstance(q, dict) and q.get("quant_method") == "mxfp4"


def dequantized_shape(blocks_shape: tuple[int, ...]) -> tuple[int, ...]:
    """[E, Out, G, 16] blocks -> the [E, G*32, Out] stack they hold."""
    *lead, out, groups, width = blocks_shape
    return (*lead, groups * 2 * width, out)


def check_pair(name: str, blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> None:
    if len(blocks_shape) != 4 or blocks_shape[-1] != VALUES_PER_BLOCK // 2 or tuple(blocks_shape[:-1]) != tuple(scales_shape):
        raise UnsupportedModelError(f"{name}: MXFP4 blocks {list(blocks_shape)} and scales {list(scales_shape)} are not "
                                    f"[E, Out, G, {VALUES_PER_BLOCK // 2}] and [E, Out, G]")


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """blocks [E, Out, G, 16] uint8, scales [E, Out, G] uint8 -> the stack [E, G*32, Out] in `dtype`."""
    codes = blocks.to(torch.uint8)
    lut = torch.tensor(E2M1, dtype=torch.float32)
    values = torch.stack((lut[(codes & 0x0F).long()], lut[(codes >> 4).long()]), dim=-1)  # [E, Out, G, 16, 2]
    values = values.flatten(-2) * torch.exp2(scales.to(torch.float32) - 127.0)[..., None]  # [E, Out, G, 32]
    return values.flatten(-2).transpose(-1, -2).to(dtype).contiguous()
