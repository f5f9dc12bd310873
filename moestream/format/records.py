"""Expert record layout: how one expert's gate/up/down tensors sit inside one aligned record."""
from __future__ import annotations

import torch

from moestream.format.manifest import FIELD_ALIGN, RECORD_ALIGN, RecordField

DTYPE_NAMES = {torch.uint32: "U32", torch.int32: "I32", torch.float32: "F32", torch.bfloat16: "BF16",
               torch.float16: "F16", torch.uint8: "U8"}
DTYPES = {v: k for k, v in DTYPE_NAMES.items()}


def round_up(value: int, align: int) -> int:
    return (value + align - 1) // align * align


def plan_record(tensors: dict[str, torch.Tensor]) -> tuple[list[RecordField], int]:
    """Lay out named tensors (in the given order) into one record; returns fields and record size."""
    fields, offset = [], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        fields.append(RecordField(name, DTYPE_NAMES[t.dtype], list(t.shape), offset, nbytes))
        offset = round_up(offset + nbytes, FIELD_ALIGN)
    return fields, round_up(max(offset, 1), RECORD_ALIGN)


def encode_record(fields: list[RecordField], record_size: int, tensors: dict[str, torch.Tensor]) -> bytes:
    """Serialize tensors into a zero-padded record matching `fields` (shapes and dtypes checked)."""
    buf = bytearray(record_size)
    for f in fields:
        t = tensors[f.name]
        if list(t.shape) != f.shape or DTYPE_NAMES[t.dtype] != f.dtype:
            raise ValueError(f"{f.name}: got {DTYPE_NAMES.get(t.dtype)} {list(t.shape)}, layout says {f.dtype} {f.shape}")
        raw = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
        buf[f.offset:f.offset + f.nbytes] = raw
    return bytes(buf)


def decode_record(fields: list[RecordField], record: torch.Tensor) -> dict[str, torch.Tensor]:
    """Views of each field inside a uint8 record tensor (no copy; works on any device)."""
    out = {}
    for f in fields:
        raw = record[f.offset:f.offset + f.nbytes]
        dtype = DTYPES[f.dtype]
        if dtype == torch.uint32:
            dtype = torch.int32  # kernels unpack with shifts and masks; int32 has full op support
        out[f.name] = raw.view(dtype).reshape(f.shape)
    return out
