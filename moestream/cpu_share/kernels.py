"""Routed experts on the CPU in native code, straight from the project's expert records in host RAM
(native/cpu_experts.cpp beside this file): no repacking, float32 accumulation. They compute the CPU
device's own experts (moestream.layers.native_experts), its resident matrices kept packed
(moestream.layers.packed_matrix: the same row products) and the CPU share of a GPU's misses (the
worker loop), all on the activations `activations()` names.

For each (token, expert) pair: the gate and up products, SiLU(gate)·up, the down product, times the
routing weight, from the record's 4- or 8-bit code words and their per-group scales and biases
(w = scale·q + bias; moestream.kernels.expert_layout), or MXFP4 records' e2m1 codes and power-of-two
scales (w = e2m1(q)·2^(e - 127), moestream.quant.mxfp4); gpt-oss's records (activation
"clamped_swiglu") add their gate/up/down biases to the products and take the clamped SwiGLU of
moestream.layers.clamped_swiglu, the layout carrying the activation, its alpha and limit. On a
spinning team of threads (native/team.h): the gate/up rows of all its experts dealt out to the
threads, then the down rows. The same file holds
the CPU share's worker loop (moestream.cpu_share.worker).

The extension is compiled at first use (torch.utils.cpp_extension, `-O3 -march=native`, cached in
torch's extensions directory). Where it cannot be built (no compiler, no ninja) `load` returns None
and `reason()` says why in one line; there is then no CPU share, and the CPU device's experts take the
torch reference. `refusal` names the layouts it does not compute (activations other than SwiGLU
and the clamped SwiGLU, unquantized, mixed group sizes or modes, ...).

Activations: on a CPU with AVX-512 VNNI (the extension's `VNNI`) each token's input and each pair's
h are quantized per group to int8 and the codes multiplied as bytes (native/int8_rows.h), several
times the float rows' speed per core, within bf16's rounding of the float result; elsewhere the
float32 rows run. A layout carries the choice (`layout(..., int8_activations=)`, for tests);
`activations()` names the default."""
from __future__ import annotations

import struct
import threading
from pathlib import Path

import torch

from moestream.format.records import encode_record, plan_record
from moestream.kernels.reference import BIASED_ACTIVATIONS
from moestream.quant import mxfp4


SOURCE = Path(__file__).with_name("native") / "cpu_experts.cpp"
NAME = "moestream_cpu_experts"
FLAGS = ["-O3", "-march=native", "-fopenmp-simd"]  # OpenMP's simd pragmas only: the team is the file's own
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
GROUPS = (32, 64, 128, 256)
SCALE_TYPES = {"BF16": 0, "F16": 1, "F32": 2}
SCALE_ITEM = {"BF16": 2, "F16": 2, "F32": 4}
E8M0 = 3  # the native code's scale type of MXFP4 records (one power-of-two byte per 32 inputs)
LAYOUT_LEN = 24  # entries of a layout tensor (the native code's LayoutIndex)
INT8_ACTS = 15  # its entry asking for int8 activations (the record's bytes stay the last)
ACTIVATIONS = {"silu": 0, "clamped_swiglu": 1}  # the native code's Activation
NO_BIAS = -1  # the bias type of records without added biases

_lock = threading.Lock()
_state: dict = {}  # "module" once built, or "reason" why not


def load():
    """The compiled extension, built on the first call (None where it cannot be: `reason()` says why)."""
    with _lock:
        if "module" in _state or "reason" in _state:
            return _state.get("module")
        try:
            from torch.utils.cpp_extension import load as build

            _state["module"] = build(f"{NAME}_{_digest()}", [str(SOURCE)], extra_cflags=FLAGS, verbose=False)
        except Exception as exc:  # noqa: BLE001 - no compiler, no ninja, a failed build: no CPU share
            _state["reason"] = _why(exc)  # the share's start says it, once (moestream.layers.experts)
        return _state.get("module")


def _digest() -> str:
    """A digest of every file of the native folder, in the extension's name: torch's build cache
    knows an extension by its name, so each version of the sources (headers included) gets its own
    build, and two checkouts of different versions never rebuild each other's."""
    import hashlib

    h = hashlib.sha256()
    for path in sorted(SOURCE.parent.iterdir()):
        h.update(path.name.encode() + path.read_bytes())
    return h.hexdigest()[:16]


def _why(exc: Exception) -> str:
    """A build failure in one line: the compiler's first error where there is one."""
    text = str(exc)
    errors = [line.strip() for line in text.splitlines() if "error" in line.lower()]
    line = errors[1] if len(errors) > 1 and errors[0].startswith("Error building") else (errors or [text])[0]
    return " ".join(line.split())[:300] or type(exc).__name__


def reason() -> str | None:
    """Why `load` found no extension (None where it built, or before it was asked)."""
    return _state.get("reason")


def vnni() -> bool:
    """Whether the extension has the int8 rows (built for a CPU with AVX-512 VNNI)."""
    module = load()
    return bool(module is not None and module.VNNI)


def activations() -> str:
    """The activations the native rows use: "int8" (quantized per group) where the CPU has VNNI,
    else "float"."""
    return "int8" if vnni() else "float"


def refusal(fields, quant) -> str | None:
    """Why the native kernels cannot compute records of this layout (None: they can)."""
    by_name = {f.name: f for f in fields}
    specs = [quant.get(p) for p in PROJECTIONS]
    if any(s is None or not s.quantized for s in specs):
        return "a projection is not quantized (the native kernels take 4- and 8-bit records)"
    modes = {s.mode for s in specs}
    if modes - {"affine", mxfp4.MODE} or len(modes) > 1:
        return f"quant modes {sorted(modes)} (the native kernels take affine or {mxfp4.MODE} records)"
    activation = specs[0].activation
    if activation not in ACTIVATIONS:
        return f"the native kernels compute SwiGLU and the clamped SwiGLU only, not {activation}"
    if activation == "clamped_swiglu" and (specs[0].alpha is None or specs[0].limit is None):
        return "a clamped SwiGLU without its alpha and limit"
    if modes == {mxfp4.MODE}:
        return _mxfp4_refusal(by_name, specs) or _added_bias_refusal(by_name, activation)
    if any(s.bits not in (4, 8) for s in specs) or specs[0].bits != specs[1].bits:
        return "codes of other than 4 or 8 bits, or gate and up of different widths"
    if len({s.group_size for s in specs}) != 1 or specs[0].group_size not in GROUPS:
        return f"group sizes {sorted({s.group_size for s in specs})} (the native kernels take one of {GROUPS})"
    for p in PROJECTIONS:
        for part in ("weight", "scales", "biases"):
            if f"{p}.{part}" not in by_name:
                return f"the record has no {p}.{part}"
    group, bits_gu, bits_d = specs[0].group_size, specs[0].bits, specs[2].bits
    inter, words = by_name["gate_proj.weight"].shape
    hidden = words * 32 // bits_gu
    expect = {"gate_proj": (inter, hidden, bits_gu), "up_proj": (inter, hidden, bits_gu),
              "down_proj": (hidden, inter, bits_d)}
    kinds = {by_name[f"{p}.{s}"].dtype for p in PROJECTIONS for s in ("scales", "biases")}
    if len(kinds) != 1 or next(iter(kinds)) not in SCALE_TYPES:
        return f"scales and biases of dtypes {sorted(kinds)} (the native kernels take one of BF16, F16, F32)"
    item = SCALE_ITEM[next(iter(kinds))]
    if hidden % group or inter % group:
        return f"hidden {hidden} / intermediate {inter} not multiples of the group size {group}"
    for p, (rows, cols, bits) in expect.items():
        w = by_name[f"{p}.weight"]
        if w.dtype not in ("U32", "I32") or list(w.shape) != [rows, cols * bits // 32] or w.offset % 4:
            return f"{p}.weight: {w.dtype} {list(w.shape)} at {w.offset} (expected U32 {[rows, cols * bits // 32]})"
        for s in ("scales", "biases"):
            f = by_name[f"{p}.{s}"]
            if list(f.shape) != [rows, cols // group] or f.offset % item:
                return f"{p}.{s}: shape {list(f.shape)} at {f.offset} (expected {[rows, cols // group]})"
    return _added_bias_refusal(by_name, activation)


def _mxfp4_refusal(by_name, specs) -> str | None:
    """Why MXFP4 records (moestream.quant.mxfp4's layout) cannot be computed (None: they can)."""
    for p, spec in zip(PROJECTIONS, specs):
        problem = mxfp4.record_problem(p, spec, *(list(by_name[f"{p}.{part}"].shape) if f"{p}.{part}" in by_name
                                                  else None for part in ("weight", "scales")))
        if problem is not None:
            return problem
        if {by_name[f"{p}.weight"].dtype, by_name[f"{p}.scales"].dtype} != {"U8"}:
            return f"{p}: MXFP4 weight and scales of dtypes other than U8"
    inter, hidden = by_name["gate_proj.weight"].shape[0], by_name["gate_proj.weight"].shape[1] * 2
    expect = {"gate_proj": [inter, hidden], "up_proj": [inter, hidden], "down_proj": [hidden, inter]}
    for p, (rows, cols) in expect.items():
        if list(by_name[f"{p}.weight"].shape) != [rows, cols // 2]:
            return f"{p}.weight: shape {list(by_name[f'{p}.weight'].shape)} (expected {[rows, cols // 2]})"
    return None


def _added_bias_refusal(by_name, activation: str) -> str | None:
    """Why a biased activation's added biases cannot be read (None: they can, or there are none)."""
    if activation not in BIASED_ACTIVATIONS:
        return None
    inter, hidden = by_name["gate_proj.weight"].shape[0], by_name["down_proj.weight"].shape[0]
    return _bias_refusal(by_name, {"gate_proj": inter, "up_proj": inter, "down_proj": hidden})


def _bias_refusal(by_name, sizes: dict[str, int]) -> str | None:
    """Why a biased activation's added biases (`{proj}.bias`, one dtype) cannot be read (None: they can)."""
    missing = [f"{p}.bias" for p in PROJECTIONS if f"{p}.bias" not in by_name]
    if missing:
        return f"the record has no {missing[0]}"
    kinds = {by_name[f"{p}.bias"].dtype for p in PROJECTIONS}
    if len(kinds) != 1 or next(iter(kinds)) not in SCALE_TYPES:
        return f"added biases of dtypes {sorted(kinds)} (the native kernels take one of BF16, F16, F32)"
    item = SCALE_ITEM[next(iter(kinds))]
    for p, size in sizes.items():
        f = by_name[f"{p}.bias"]
        if list(f.shape) != [size] or f.offset % item:
            return f"{p}.bias: shape {list(f.shape)} at {f.offset} (expected {[size]})"
    return None


def _float_bits(value: float) -> int:
    """A float32's bits as an integer (the layout carries alpha and limit so)."""
    return struct.unpack("<i", struct.pack("<f", value))[0]


def layout(fields, quant, int8_activations: bool | None = None) -> torch.Tensor:
    """The int64 [LAYOUT_LEN] description of a layout the kernels take (it must have passed
    `refusal`): hidden, intermediate, the bits of gate/up and down, the group size, the scales'
    dtype, the byte offsets of the nine fields, whether to run on int8 activations (None:
    `activations()`; without VNNI the float rows run all the same), the activation with its alpha
    and limit, the added biases' dtype (NO_BIAS: none) and offsets, and the record's bytes (for GB/s)."""
    by_name = {f.name: f for f in fields}
    mx = quant["gate_proj"].mode == mxfp4.MODE
    inter, cols = by_name["gate_proj.weight"].shape
    bits_gu = quant["gate_proj"].bits
    values = [cols * 2 if mx else cols * 32 // bits_gu, inter, bits_gu, quant["down_proj"].bits,
              quant["gate_proj"].group_size, E8M0 if mx else SCALE_TYPES[by_name["gate_proj.scales"].dtype]]
    values += [by_name[f"{p}.{s}"].offset if f"{p}.{s}" in by_name else 0  # MXFP4: no biases
               for p in PROJECTIONS for s in ("weight", "scales", "biases")]
    values.append(int(activations() == "int8" if int8_activations is None else int8_activations))
    spec = quant["gate_proj"]
    clamped = spec.activation == "clamped_swiglu"
    values += [ACTIVATIONS[spec.activation], _float_bits(spec.alpha) if clamped else 0,
               _float_bits(spec.limit) if clamped else 0]
    parts = ("weight", "scales") if mx else ("weight", "scales", "biases")
    if spec.activation in BIASED_ACTIVATIONS:
        values.append(SCALE_TYPES[by_name["gate_proj.bias"].dtype])
        values += [by_name[f"{p}.bias"].offset for p in PROJECTIONS]
        parts += ("bias",)
    else:
        values += [NO_BIAS, 0, 0, 0]
    values.append(sum(by_name[f"{p}.{s}"].nbytes for p in PROJECTIONS for s in parts))
    return torch.tensor(values, dtype=torch.int64)


def record_blob(tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, list]:
    """One record's tensors laid out as the packed format does (tests, the benchmark): its bytes
    (uint8) and its fields."""
    fields, size = plan_record(tensors)
    blob = torch.frombuffer(bytearray(encode_record(fields, size, tensors)), dtype=torch.uint8)
    return blob, fields


def weighted_rows(module, layout_t: torch.Tensor, records: list[torch.Tensor], experts, tokens, weights,
                  x: torch.Tensor, out: torch.Tensor, threads: int) -> None:
    """out[p] = weights[p] * the gated FFN of records[experts[p]] at x[tokens[p]] (x float32 [T, H]; out
    float32 [>= P, H]); records: uint8 tensors kept alive by the caller."""
    addresses = torch.tensor([r.data_ptr() for r in records], dtype=torch.int64)
    module.weighted_rows(layout_t, addresses, torch.as_tensor(experts, dtype=torch.int32),
                         torch.as_tensor(tokens, dtype=torch.int32), torch.as_tensor(weights, dtype=torch.float32),
                         x.float().contiguous(), out, int(threads))


__all__ = ["load", "reason", "vnni", "activations", "refusal", "layout", "record_blob", "weighted_rows"]
