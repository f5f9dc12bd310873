"""GPTQ and AWQ checkpoints: group-wise integer weights as the Hub stores them, read exactly.

Both store a linear layer's weight transposed, [I, O], as integer codes q, per-group zeros z and
scales s, with w = s · (q − z):

  GPTQ  qweight int32 [I·b/32, O]  codes packed along the input, element j of a word at bits j·b
        qzeros  int32 [G, O·b/32]  packed along the output the same way; format "gptq" (v1)
                                   stores z − 1 (a nibble 0xF reads as 16), "gptq_v2" stores z
        scales  [G, O]             g_idx int32 [I]: the group of each input (with act-order, desc_act,
                                   not i // group_size)
  AWQ   qweight int32 [I, O·b/32]  packed along the output in the order 0 2 4 6 1 3 5 7 (GEMM kernels)
        qzeros  int32 [G, O·b/32]  the same packing, z itself
        scales  [G, O]             groups are consecutive inputs

`dequantize` gives s·(q − z) computed exactly in float32 (one rounding of the exact product, so
its fp16 rounding is the fp16 result of the reference implementations). `to_affine` gives the same
values in our layout (codes q, scale s, bias −z·s in float32), exact where the groups are runs of
consecutive inputs and the scales 16-bit floats."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from moestream.quant.affine import pack

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column a word's j-th 4-bit element holds, per 8


class GroupwiseFormatError(ValueError):
    """A quantization config or tensor that does not follow the GPTQ/AWQ layout."""


@dataclass(frozen=True)
class GroupwiseConfig:
    """config.json's quantization_config of a GPTQ or AWQ checkpoint."""

    method: str  # "gptq" or "awq"
    bits: int
    group_size: int  # -1: one group per row (the whole input)
    act_order: bool = False  # GPTQ desc_act: g_idx is a permutation's grouping, not i // group_size
    zeros_minus_one: bool = False  # GPTQ "gptq" (v1) checkpoint format

    @staticmethod
    def from_config(q: dict) -> "GroupwiseConfig":
        method = q.get("quant_method")
        bits, group = q.get("bits", q.get("w_bit")), q.get("group_size", q.get("q_group_size"))
        if not isinstance(bits, int) or not isinstance(group, int):
            raise GroupwiseFormatError(f"quantization_config lacks integer bits and group_size ({method})")
        if method == "gptq":
            if bits not in (2, 4, 8):
                raise GroupwiseFormatError(f"{bits}-bit GPTQ is not supported (supported: 2, 4, 8)")
            fmt = q.get("checkpoint_format", "gptq")
            if fmt not in ("gptq", "gptq_v2"):
                raise GroupwiseFormatError(f"GPTQ checkpoint_format {fmt!r} is not supported (supported: gptq, gptq_v2)")
            if q.get("dynamic"):
                raise GroupwiseFormatError("GPTQ with per-module settings (dynamic) is not supported")
            return GroupwiseConfig("gptq", bits, group, bool(q.get("desc_act", False)), fmt == "gptq")
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise GroupwiseFormatError(f"AWQ version {version!r} is not supported (supported: gemm)")
            if bits != 4:
                raise GroupwiseFormatError(f"{bits}-bit AWQ is not supported (supported: 4)")
            if q.get("zero_point", True) is not True:
                raise GroupwiseFormatError("AWQ without zero points is not supported")
            return GroupwiseConfig("awq", bits, group)
        raise GroupwiseFormatError(f"quant_method {method!r} is not GPTQ or AWQ")

    def group_of_inputs(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


def _unpack_last(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, W] -> int64 codes [R, W·32/b], element j of each word next to each other."""
    per_word = 32 // bits
    w = words.to(torch.int64) & 0xFFFFFFFF
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    return ((w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(w.shape[0], -1)


@dataclass
class GroupwiseWeight:
    """One layer's codes [I, O], zeros [G, O], scales [G, O] and input groups [I], unpacked."""

    codes: torch.Tensor
    zeros: torch.Tensor
    scales: torch.Tensor
    g_idx: torch.Tensor

    @staticmethod
    def unpack(config: GroupwiseConfig, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
               g_idx: torch.Tensor | None = None) -> "GroupwiseWeight":
        bits = config.bits
        if config.method == "gptq":
            codes = _unpack_last(qweight.T.contiguous(), bits).T  # [I, O]: packed along the input
            zeros = _unpack_last(qzeros, bits)
            if config.zeros_minus_one:
                zeros = zeros + 1
        else:
            order = torch.tensor([AWQ_ORDER.index(c) for c in range(8)])  # column c sits at element order[c]
            def unshuffle(t):
                return t.reshape(t.shape[0], -1, 8)[..., order].reshape(t.shape[0], -1)
            codes, zeros = unshuffle(_unpack_last(qweight, bits)), unshuffle(_unpack_last(qzeros, bits))
        in_features, out_features = codes.shape
        if tuple(scales.shape) != tuple(zeros.shape) or scales.shape[1] != out_features:
            raise GroupwiseFormatError(f"scales {list(scales.shape)} and zeros {list(zeros.shape)} do not fit "
                                       f"{in_features} inputs × {out_features} outputs")
        group = config.group_of_inputs(in_features)
        if in_features % group or scales.shape[0] != in_features // group:
            raise GroupwiseFormatError(f"{scales.shape[0]} groups do not cover {in_features} inputs in groups of {group}")
        in_order = torch.arange(in_features, dtype=torch.int64) // group
        if g_idx is None:
            g_idx = in_order
        else:
            g_idx = g_idx.to(torch.int64)
            if tuple(g_idx.shape) != (in_features,) or g_idx.min() < 0 or g_idx.max() >= scales.shape[0]:
                raise GroupwiseFormatError(f"g_idx {list(g_idx.shape)} is not a group for each of {in_features} inputs")
            if not config.act_order and not torch.equal(g_idx, in_order):
                raise GroupwiseFormatError("g_idx is not in input order, but desc_act is false")
        return GroupwiseWeight(codes, zeros, scales, g_idx)

    @property
    def in_order(self) -> bool:
        """Groups are runs of consecutive inputs (no act-order): our affine layout holds them."""
        group = self.codes.shape[0] // self.scales.shape[0]
        return torch.equal(self.g_idx, torch.arange(self.codes.shape[0]) // group)

    def dequantize(self) -> torch.Tensor:
        """[O, I] float32: s · (q − z), exact."""
        scale = self.scales.to(torch.float32)[self.g_idx]  # [I, O]
        zero = self.zeros[self.g_idx]
        return (scale * (self.codes - zero).to(torch.float32)).T.contiguous()

    def to_affine(self, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(uint32 words [O, I·b/32], scales [O, G], biases [O, G]), float32 scale and bias:
        q·s and z·s are exact in float32 for 16-bit s, and so is their difference."""
        if not self.in_order:
            raise GroupwiseFormatError("act-order groups cannot be kept as consecutive groups")
        scales = self.scales.to(torch.float32)
        biases = -(self.zeros.to(torch.float32) * scales)
        return pack(self.codes.T.contiguous().to(torch.int32), bits), scales.T.contiguous(), biases.T.contiguous()
