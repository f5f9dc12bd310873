"""The expert record layouts the Triton MoE kernels read (moestream.kernels.triton_moe): where each
field sits in a slot (SlotLayout, from a record's fields and quantization), which layouts they take
(UnsupportedLayout says why not), and the kernels' tile settings (KernelConfig). Pure Python and
torch: deciding whether a layer can take the kernels needs no Triton."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moestream.kernels.reference import BIASED_ACTIVATIONS, GATE_ACTIVATIONS
from moestream.quant import mxfp4

GROUP = 64  # quantization group size the kernels are written for (and their grouped kernels' K step)
MX_GROUP = mxfp4.VALUES_PER_BLOCK  # inputs per E8M0 scale of an MXFP4 record
SUPPORTED_BITS = (4, 8)
SCALE_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16}
ACT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BIAS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


class UnsupportedLayout(ValueError):
    """A record layout the Triton kernels do not handle (the caller falls back to the reference)."""


@dataclass(frozen=True)
class SlotLayout:
    """Where one layer's expert tensors sit inside a slot; identical for every record of the layer.

    Offsets are in bytes from the start of the slot."""

    hidden: int  # H
    inter: int  # I
    bits_gate_up: int
    bits_down: int
    scale_dtype: torch.dtype
    offsets: dict[str, int] = field(hash=False)  # "gate_proj.weight" -> byte offset, ... (9 fields, 12 with biases;
    # MXFP4: 6 fields, 9 with biases)
    record_bytes: int = 0  # weight + scales + biases bytes of one expert (for bandwidth reports)
    activation: str = "silu"  # one of GATE_ACTIVATIONS (a compile-time choice of the kernels)
    alpha: float = 0.0  # clamped_swiglu's settings (unused by the others)
    limit: float = 0.0
    bias_dtype: torch.dtype | None = None  # dtype of gate_proj.bias, up_proj.bias, down_proj.bias; None: no biases
    mx: bool = False  # MXFP4 records: uint8 weight and E8M0 scales per projection, no quantization biases

    @property
    def has_bias(self) -> bool:
        return self.bias_dtype is not None

    @staticmethod
    def from_fields(fields, quant) -> "SlotLayout":
        """Validate a record layout (RecordField list + {proj: QuantSpec}); raise UnsupportedLayout."""
        by_name = {f.name: f for f in fields}
        spec = quant.get("gate_proj")
        activation = spec.activation if spec is not None else "silu"
        if activation not in GATE_ACTIVATIONS:
            raise UnsupportedLayout(f"activation {activation!r} (kernels handle {', '.join(GATE_ACTIVATIONS)})")
        if activation == "clamped_swiglu" and (spec.alpha is None or spec.limit is None):
            raise UnsupportedLayout("clamped_swiglu needs its alpha and limit in the quant spec")
        for proj in PROJECTIONS:
            spec = quant.get(proj)
            if spec is None or not spec.quantized:
                raise UnsupportedLayout(f"{proj} is not quantized")
        alpha, limit = (spec.alpha, spec.limit) if activation == "clamped_swiglu" else (0.0, 0.0)
        modes = {quant[p].mode for p in PROJECTIONS}
        if modes == {mxfp4.MODE}:
            return _mxfp4_layout(by_name, quant, activation, float(alpha), float(limit))
        if modes != {"affine"}:
            raise UnsupportedLayout(f"quant modes {sorted(modes)} (kernels handle all three projections affine "
                                    f"or all three {mxfp4.MODE})")
        for proj in PROJECTIONS:
            spec = quant[proj]
            if spec.bits not in SUPPORTED_BITS:
                raise UnsupportedLayout(f"{proj}: {spec.bits}-bit codes (kernels handle {SUPPORTED_BITS})")
            if spec.group_size != GROUP:
                raise UnsupportedLayout(f"{proj}: group size {spec.group_size} (kernels handle {GROUP})")
            for part in ("weight", "scales", "biases"):
                if f"{proj}.{part}" not in by_name:
                    raise UnsupportedLayout(f"record has no {proj}.{part}")
        if quant["gate_proj"].bits != quant["up_proj"].bits:
            raise UnsupportedLayout("gate_proj and up_proj have different bit widths")
        scale_names = {by_name[f"{p}.{s}"].dtype for p in PROJECTIONS for s in ("scales", "biases")}
        if len(scale_names) != 1 or next(iter(scale_names)) not in SCALE_DTYPES:
            raise UnsupportedLayout(f"scales/biases dtypes {sorted(scale_names)} (kernels handle one of BF16, F16)")
        gate_w = by_name["gate_proj.weight"]
        inter = gate_w.shape[0]
        hidden = gate_w.shape[1] * 32 // quant["gate_proj"].bits
        bits_gu, bits_d = quant["gate_proj"].bits, quant["down_proj"].bits
        expect = {
            "gate_proj.weight": [inter, hidden * bits_gu // 32], "up_proj.weight": [inter, hidden * bits_gu // 32],
            "down_proj.weight": [hidden, inter * bits_d // 32],
            "gate_proj.scales": [inter, hidden // GROUP], "up_proj.scales": [inter, hidden // GROUP],
            "down_proj.scales": [hidden, inter // GROUP],
        }
        for proj in PROJECTIONS:
            expect[f"{proj}.biases"] = expect[f"{proj}.scales"]
        for name, shape in expect.items():
            f = by_name[name]
            if list(f.shape) != shape:
                raise UnsupportedLayout(f"{name}: shape {list(f.shape)}, expected {shape}")
            if name.endswith(".weight") and f.dtype not in ("U32", "I32"):
                raise UnsupportedLayout(f"{name}: dtype {f.dtype}, expected U32")
            if f.offset % 4:
                raise UnsupportedLayout(f"{name}: offset {f.offset} is not 4-byte aligned")
        if hidden % GROUP or inter % GROUP:
            raise UnsupportedLayout(f"hidden {hidden} / intermediate {inter} not multiples of {GROUP}")
        bias_dtype = _bias_dtype(by_name, hidden, inter) if activation in BIASED_ACTIVATIONS else None
        names = list(expect) + ([f"{p}.bias" for p in PROJECTIONS] if bias_dtype is not None else [])
        return SlotLayout(hidden, inter, bits_gu, bits_d, SCALE_DTYPES[next(iter(scale_names))],
                          {name: by_name[name].offset for name in names},
                          sum(by_name[name].nbytes for name in names), activation, float(alpha), float(limit),
                          bias_dtype)


def _mxfp4_layout(by_name, quant, activation: str, alpha: float, limit: float) -> SlotLayout:
    """The SlotLayout of MXFP4 records (moestream.quant.mxfp4's layout); UnsupportedLayout if they do not fit."""
    for proj in PROJECTIONS:
        spec = quant[proj]
        if spec.bits != 4 or spec.group_size != MX_GROUP:
            raise UnsupportedLayout(f"{proj}: MXFP4 with bits {spec.bits}, group size {spec.group_size} "
                                    f"(kernels handle 4 and {MX_GROUP})")
        for part in ("weight", "scales"):
            if f"{proj}.{part}" not in by_name:
                raise UnsupportedLayout(f"record has no {proj}.{part}")
    gate_w = by_name["gate_proj.weight"]
    inter, hidden = gate_w.shape[0], gate_w.shape[1] * 2
    expect = {
        "gate_proj.weight": [inter, hidden // 2], "up_proj.weight": [inter, hidden // 2],
        "down_proj.weight": [hidden, inter // 2],
        "gate_proj.scales": [inter, hidden // MX_GROUP], "up_proj.scales": [inter, hidden // MX_GROUP],
        "down_proj.scales": [hidden, inter // MX_GROUP],
    }
    for name, shape in expect.items():
        f = by_name[name]
        if list(f.shape) != shape:
            raise UnsupportedLayout(f"{name}: shape {list(f.shape)}, expected {shape}")
        if f.dtype != "U8":
            raise UnsupportedLayout(f"{name}: dtype {f.dtype}, expected U8")
        if name.endswith(".weight") and f.offset % 4:  # read as int32 words
            raise UnsupportedLayout(f"{name}: offset {f.offset} is not 4-byte aligned")
    if hidden % GROUP or inter % GROUP:  # the grouped kernels step over 64 inputs (two scales) at a time
        raise UnsupportedLayout(f"hidden {hidden} / intermediate {inter} not multiples of {GROUP}")
    bias_dtype = _bias_dtype(by_name, hidden, inter) if activation in BIASED_ACTIVATIONS else None
    names = list(expect) + ([f"{p}.bias" for p in PROJECTIONS] if bias_dtype is not None else [])
    return SlotLayout(hidden, inter, 4, 4, torch.uint8, {name: by_name[name].offset for name in names},
                      sum(by_name[name].nbytes for name in names), activation, alpha, limit, bias_dtype, mx=True)


def _bias_dtype(by_name, hidden: int, inter: int) -> torch.dtype:
    """The one float dtype of a record's gate/up/down added biases ([I], [I], [H]); UnsupportedLayout if not."""
    shapes = {"gate_proj.bias": [inter], "up_proj.bias": [inter], "down_proj.bias": [hidden]}
    for name, shape in shapes.items():
        if name not in by_name:
            raise UnsupportedLayout(f"record has no {name}")
        if list(by_name[name].shape) != shape:
            raise UnsupportedLayout(f"{name}: shape {list(by_name[name].shape)}, expected {shape}")
    dtypes = {by_name[name].dtype for name in shapes}
    if len(dtypes) != 1 or next(iter(dtypes)) not in BIAS_DTYPES:
        raise UnsupportedLayout(f"bias dtypes {sorted(dtypes)} (kernels handle one of {', '.join(BIAS_DTYPES)})")
    dtype = BIAS_DTYPES[next(iter(dtypes))]
    for name in shapes:
        if by_name[name].offset % dtype.itemsize:
            raise UnsupportedLayout(f"{name}: offset {by_name[name].offset} is not aligned to its dtype")
    return dtype


@dataclass(frozen=True)
class KernelConfig:
    """Block sizes. They change summation order, so they depend only on the shape of the call (T,
    U, dtypes), never on the cache -- the same call gives the same bits for any cache."""

    gemv_max_tokens: int = 4  # T at or below this takes the gemv kernels
    gemv_gate_up_n: int = 16  # output rows per program
    gemv_gate_up_words: int = 64  # uint32 words of each row per loop step (a power of two >= 2*bits)
    gemv_gate_up_warps: int = 8  # swept on the H200 at the 30B shape (scripts/bench_kernels.py --sweep)
    gemv_down_n: int = 32
    gemv_down_words: int = 32
    gemv_down_warps: int = 8
    # grouped (prefill) kernels, swept on the H200 at the 30B shape at 512 and 2,048 tokens with uniform and
    # skewed routing (scripts/bench_kernels.py --sweep): 2.2-2.5x faster than the tiles before
    block_m: int = 0  # pairs per tile; 0: the power of two >= block_m_scale x the mean pairs per expert
    block_m_scale: int = 2  # (from 16 up to block_m_max)
    block_m_max: int = 128
    gate_up_n: int = 64
    down_n: int = 64
    grouped_warps: int = 4
    grouped_stages: int = 4
    combine_tokens: int = 4
    combine_block: int = 256
    # products over a decode step's 16-row tile (moestream.kernels.triton_rows),
    # in three classes by shape: narrow (at most rows_narrow_max outputs: a router), deep (at least
    # rows_deep_from inputs: an o projection) and wide (the rest: q/k/v, a head). Each: output columns
    # per program, inputs per loop step, warps, pipeline stages, the weights on the MMA's M side (swap:
    # Hopper's wgmma, n >= 64) and the splits of K (their partials added in a fixed order; only for
    # products with fewer than rows_split_below column blocks). Swept on the H200 at the 30B shape
    # (scripts/bench_kernels.py --rows-sweep): the router 4.7 -> 3.4 us with 8 splits, o 8.6 -> 7.7
    # with 4, q/k/v 8.6 -> 7.8 on wgmma
    rows_n: int = 64
    rows_k: int = 256
    rows_warps: int = 4
    rows_stages: int = 4
    rows_swap: int = 1
    rows_split: int = 1
    rows_narrow_max: int = 1024
    rows_narrow_n: int = 16
    rows_narrow_k: int = 256
    rows_narrow_warps: int = 4
    rows_narrow_stages: int = 3
    rows_narrow_swap: int = 0
    rows_narrow_split: int = 8
    rows_deep_from: int = 4096
    rows_deep_n: int = 32
    rows_deep_k: int = 128
    rows_deep_warps: int = 2
    rows_deep_stages: int = 4
    rows_deep_swap: int = 0
    rows_deep_split: int = 4
    rows_split_below: int = 1024
    pdl: int = 1  # the decode step's Triton kernels with programmatic dependent launch (moestream.kernels.pdl)


# The block sizes of every call: one setting for the whole process, so the bits depend only on the
# call's shape (a sweep's best, scripts/bench_kernels.py --best-out, becomes the defaults above).
DEFAULT_CONFIG = KernelConfig()
