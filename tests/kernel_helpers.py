"""Random expert records in the packed record layout, a slot pool holding them, and the float
reference the MoE kernels are checked against (dequantize each chosen expert, run its SwiGLU,
weight and sum)."""
from __future__ import annotations

from typing import Sequence

import torch

from moestream.format.records import decode_record, encode_record, plan_record
from moestream.kernels.reference import expert_ffn
from moestream.quant.affine import QuantSpec

GROUP = 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def random_expert(hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
                  scale_dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, QuantSpec]]:
    """One expert's record tensors: random codes, and scales/biases chosen so each dequantized
    weight has mean near zero and variance near 1/in_features (unit-scale outputs)."""
    tensors: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantSpec] = {}
    for proj in PROJECTIONS:
        b = (down_bits or bits) if proj == "down_proj" else bits
        out_f, in_f = (hidden, inter) if proj == "down_proj" else (inter, hidden)
        levels = (1 << b) - 1
        # int64 draws cover every 32-bit pattern; the cast to int32 keeps the low bits
        words = torch.randint(0, 1 << 32, (out_f, in_f * b // 32), dtype=torch.int64, generator=generator)
        groups = (out_f, in_f // GROUP)
        # codes are uniform on 0..levels: variance levels*(levels+2)/12 in code units
        unit = (12.0 / (in_f * levels * (levels + 2))) ** 0.5
        scales = unit * (0.5 + torch.rand(groups, generator=generator))
        biases = -scales * levels / 2 + 0.3 * in_f ** -0.5 * torch.randn(groups, generator=generator)
        tensors[f"{proj}.weight"] = words.to(torch.int32).view(torch.uint32)
        tensors[f"{proj}.scales"] = scales.to(scale_dtype)
        tensors[f"{proj}.biases"] = biases.to(scale_dtype)
        quant[proj] = QuantSpec(b, GROUP)
    return tensors, quant


def build_pool(num_experts: int, hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
               scale_dtype: torch.dtype = torch.bfloat16, extra_slots: int = 0, seed: int = 0,
               device: torch.device | str = "cpu"):
    """A slot pool of `num_experts + extra_slots` records, expert e in a shuffled slot, the bytes
    exactly what the packed format's encoder writes. Returns (pool [N, S] uint8, fields, quant,
    slot_of: the slot of each expert)."""
    gen = torch.Generator().manual_seed(seed)
    experts = [random_expert(hidden, inter, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype, generator=gen)
               for _ in range(num_experts)]
    fields, record_size = plan_record(experts[0][0])
    slot_count = num_experts + extra_slots
    slot_of = torch.randperm(slot_count, generator=gen)[:num_experts].tolist()
    pool = torch.zeros((slot_count, record_size), dtype=torch.uint8)
    for (tensors, _), slot in zip(experts, slot_of):
        pool[slot] = torch.frombuffer(bytearray(encode_record(fields, record_size, tensors)), dtype=torch.uint8)
    return pool.to(device), fields, experts[0][1], slot_of


def reference_moe(x: torch.Tensor, pool: torch.Tensor, fields, quant: dict[str, QuantSpec], ids: torch.Tensor,
                  weights: torch.Tensor, slot_of: Sequence[int], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [T, H], ids/weights [T, A] -> [T, H]: sum over a token's chosen experts of weight times
    the expert's SwiGLU, each expert's record decoded from its slot. dtype: compute dtype (x's)."""
    dtype = dtype or x.dtype
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for expert in torch.unique(ids).tolist():
        tokens, choice = torch.nonzero(ids == expert, as_tuple=True)
        record = decode_record(fields, pool[slot_of[expert]])
        y = expert_ffn(x[tokens].to(dtype), record, quant)
        out.index_add_(0, tokens, y * weights[tokens, choice].to(dtype)[:, None])
    return out
