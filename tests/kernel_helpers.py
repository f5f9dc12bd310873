"""Random expert records in the packed record layout, a slot pool holding them, and the float
reference the MoE kernels are checked against (the torch plan: dequantize each chosen expert, run
its gated FFN with the record's activation and biases, weight and sum)."""
from __future__ import annotations

import math
from typing import Sequence

import torch

from moestream.format.records import encode_record, plan_record
from moestream.kernels.reference import BIASED_ACTIVATIONS
from moestream.layers.torch_experts import TorchPlan
from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec

GROUP = 64
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def random_expert(hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
                  scale_dtype: torch.dtype = torch.bfloat16, generator: torch.Generator | None = None,
                  activation: str = "silu", alpha: float | None = None, limit: float | None = None,
                  bias_dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, torch.Tensor], dict[str, QuantSpec]]:
    """One expert's record tensors: random codes, and scales/biases chosen so each dequantized
    weight has mean near zero and variance near 1/in_features (unit-scale outputs). A biased
    activation (clamped_swiglu) also gets gate/up/down added biases in `bias_dtype`, after the
    weights as the converter writes them, of the outputs' order of size so that they matter."""
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
        quant[proj] = QuantSpec(b, GROUP, activation, alpha, limit)
    added_biases(tensors, hidden, inter, activation, bias_dtype, generator)
    return tensors, quant


def added_biases(tensors: dict, hidden: int, inter: int, activation: str, bias_dtype: torch.dtype,
                 generator: torch.Generator | None) -> None:
    """A biased activation's gate/up/down added biases, of the outputs' order of size so that they matter."""
    if activation in BIASED_ACTIVATIONS:
        for proj in PROJECTIONS:
            size = hidden if proj == "down_proj" else inter
            tensors[f"{proj}.bias"] = (0.5 * torch.randn(size, generator=generator)).to(bias_dtype)


E2M1_MEAN_SQUARE = sum(v * v for v in mxfp4.E2M1) / 16


def random_mxfp4_expert(hidden: int, inter: int, *, generator: torch.Generator | None = None, spread: int = 3,
                        activation: str = "silu", alpha: float | None = None, limit: float | None = None,
                        bias_dtype: torch.dtype = torch.bfloat16) -> tuple[dict[str, torch.Tensor], dict[str, QuantSpec]]:
    """One expert's MXFP4 record tensors (moestream.quant.mxfp4's layout): random code bytes (all 16
    codes, -0.0 included) and E8M0 scales 2^(k - 127), k within `spread` binades of the one that gives
    unit-scale outputs, drawn per group of 32 inputs."""
    tensors: dict[str, torch.Tensor] = {}
    quant: dict[str, QuantSpec] = {}
    for proj in PROJECTIONS:
        out_f, in_f = (hidden, inter) if proj == "down_proj" else (inter, hidden)
        unit = round(-0.5 * math.log2(in_f * E2M1_MEAN_SQUARE))
        exps = 127 + unit + torch.randint(-spread, spread + 1, (out_f, in_f // mxfp4.VALUES_PER_BLOCK), generator=generator)
        tensors[f"{proj}.weight"] = torch.randint(0, 256, (out_f, in_f // 2), generator=generator).to(torch.uint8)
        tensors[f"{proj}.scales"] = exps.to(torch.uint8)
        quant[proj] = QuantSpec(4, mxfp4.VALUES_PER_BLOCK, activation, alpha, limit, mode=mxfp4.MODE)
    added_biases(tensors, hidden, inter, activation, bias_dtype, generator)
    return tensors, quant


def build_pool(num_experts: int, hidden: int, inter: int, *, bits: int = 4, down_bits: int | None = None,
               scale_dtype: torch.dtype = torch.bfloat16, extra_slots: int = 0, seed: int = 0,
               device: torch.device | str = "cpu", mx_spread: int | None = None, **activation):
    """A slot pool of `num_experts + extra_slots` records, expert e in a shuffled slot, the bytes
    exactly what the packed format's encoder writes. Returns (pool [N, S] uint8, fields, quant,
    slot_of: the slot of each expert). activation: random_expert's activation, alpha, limit, bias_dtype.
    mx_spread: MXFP4 records (random_mxfp4_expert's spread) instead of affine ones."""
    gen = torch.Generator().manual_seed(seed)
    if mx_spread is not None:
        experts = [random_mxfp4_expert(hidden, inter, generator=gen, spread=mx_spread, **activation)
                   for _ in range(num_experts)]
    else:
        experts = [random_expert(hidden, inter, bits=bits, down_bits=down_bits, scale_dtype=scale_dtype,
                                 generator=gen, **activation) for _ in range(num_experts)]
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
    the expert's gated FFN (the torch plan's arithmetic), each expert's record decoded from its
    slot. dtype: compute dtype (x's)."""
    dtype = dtype or x.dtype
    plan = TorchPlan(x.to(dtype), ids, weights.to(dtype), fields, quant)
    experts = torch.unique(ids).tolist()
    plan.run(pool, experts, [slot_of[e] for e in experts])
    return plan.finish()
