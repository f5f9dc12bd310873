"""Test and benchmark helpers over slot pools (random records, a reference over a pool).

Routed experts are computed by moestream.layers.experts.RoutedExperts."""
from __future__ import annotations

from typing import Sequence

import torch

from moestream.format.records import decode_record, plan_record
from moestream.kernels.reference import expert_ffn
from moestream.quant.affine import QuantSpec


# -- test and benchmark helpers ---------------------------------------------------------------------

def random_expert(hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
                  scale_dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None
                  ) -> tuple[dict[str, torch.Tensor], dict[str, QuantSpec]]:
    """One expert's record tensors with random codes and sane scales/biases (unit-variance outputs)."""
    tensors, quant = {}, {}
    for proj in ("gate_proj", "up_proj", "down_proj"):
        b = (down_bits or bits) if proj == "down_proj" else bits
        out_f, in_f = (hidden, inter) if proj == "down_proj" else (inter, hidden)
        levels = (1 << b) - 1
        codes = torch.randint(0, 1 << 32, (out_f, in_f * b // 32), dtype=torch.int64, generator=generator)
        groups = (out_f, in_f // 64)
        half_range = (3.0 / in_f) ** 0.5  # uniform weights in [-a, a] have variance 1/in_f
        scales = 2 * half_range / levels * (0.5 + torch.rand(groups, generator=generator))
        biases = -scales * levels / 2 + 0.3 * half_range * torch.randn(groups, generator=generator)
        tensors[f"{proj}.weight"] = codes.to(torch.int32).view(torch.uint32)  # wraps; a view works on every torch
        tensors[f"{proj}.scales"] = scales.to(scale_dtype)
        tensors[f"{proj}.biases"] = biases.to(scale_dtype)
        quant[proj] = QuantSpec(b, 64)
    return tensors, quant


def build_pool(num_experts: int, hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
               scale_dtype: torch.dtype = torch.bfloat16, extra_slots: int = 0, seed: int = 0,
               device: torch.device | str = "cpu"):
    """A slot pool holding `num_experts` random records (the packed format's record layout) in
    shuffled slots. Returns (pool [N, S] uint8, fields, quant, slot_of: the slot of each expert)."""
    gen = torch.Generator().manual_seed(seed)
    first, quant = random_expert(hidden, inter, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype, generator=gen)
    fields, record_size = plan_record(first)
    slots = num_experts + extra_slots
    slot_of = torch.randperm(slots, generator=gen)[:num_experts].tolist()
    pool = torch.zeros((slots, record_size), dtype=torch.uint8, device=device)
    for e in range(num_experts):
        tensors = first if e == 0 else random_expert(hidden, inter, bits=bits, down_bits=down_bits,
                                                     scale_dtype=scale_dtype, generator=gen)[0]
        row = pool[slot_of[e]]
        for f in fields:  # the bytes encode_record would write, without a host round trip
            row[f.offset:f.offset + f.nbytes] = tensors[f.name].contiguous().reshape(-1).view(torch.uint8).to(device)
    return pool, fields, quant, slot_of


def reference_moe(x: torch.Tensor, pool: torch.Tensor, fields, quant: dict[str, QuantSpec], ids: torch.Tensor,
                  weights: torch.Tensor, slot_of: Sequence[int], *, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The torch reference over a slot pool: per expert, dequantize its record and run the SwiGLU
    (moestream.kernels.reference), weight and sum. dtype: compute dtype (default x's)."""
    dtype = dtype or x.dtype
    xc = x.to(dtype)
    out = torch.zeros(x.shape, dtype=dtype, device=x.device)
    for e in torch.unique(ids).tolist():
        tok, slot = torch.where(ids == e)
        record = decode_record(fields, pool[slot_of[e]])
        y = expert_ffn(xc[tok], record, quant) * weights[tok, slot, None].to(dtype)
        out.index_add_(0, tok, y)
    return out
