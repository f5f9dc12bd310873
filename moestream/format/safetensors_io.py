"""Safetensors read with positional reads and written as a stream.

Reading without mmap keeps a converter's resident memory to the tensors it holds (the mapped pages
of a big checkpoint would count against its RSS); writing from a header computed up front lets
tensors be produced one at a time instead of being gathered in a dict first.

The format: an 8-byte little-endian header length N, N bytes of JSON
{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}, then the
tensors' raw bytes, back to back (no gaps), offsets relative to the end of the header.
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import MoestreamError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
ITEMSIZE = {name: torch.empty((), dtype=dt).element_size() for name, dt in DTYPES.items()}
MAX_HEADER = 100 << 20  # safetensors' own limit; a larger length means the file is not safetensors


class SafetensorsError(MoestreamError):
    """A safetensors file that is truncated, corrupt or not safetensors at all."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class SafetensorsFile:
    """One safetensors file: header parsed and checked on open, tensors read on demand with pread."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "rb", buffering=0)
        except OSError as exc:
            raise SafetensorsError(f"{self.path}: cannot open ({exc.strerror})") from None
        try:
            self.size = os.fstat(self._fh.fileno()).st_size
            self.tensors, self.metadata = self._parse_header()
        except BaseException:
            self._fh.close()
            raise

    def _parse_header(self) -> tuple[dict[str, TensorInfo], dict]:
        head = self._pread(0, 8)
        if len(head) < 8:
            raise SafetensorsError(f"{self.path}: truncated safetensors file ({self.size} bytes, no header)")
        (length,) = struct.unpack("<Q", head)
        if length > MAX_HEADER or length < 2:
            raise SafetensorsError(f"{self.path}: corrupt safetensors file (header length {length} is not plausible)")
        if 8 + length > self.size:
            raise SafetensorsError(f"{self.path}: truncated safetensors file ({self.size} bytes, the header alone needs {8 + length})")
        try:
            header = json.loads(self._pread(8, length).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            raise SafetensorsError(f"{self.path}: corrupt safetensors file (the header is not valid JSON)") from None
        if not isinstance(header, dict):
            raise SafetensorsError(f"{self.path}: corrupt safetensors file (the header is not a JSON object)")
        metadata = header.pop("__metadata__", None) or {}
        base = 8 + length
        tensors, data_end = {}, 0
        for name, entry in header.items():
            try:
                dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
                ok = (dtype in DTYPES and all(isinstance(d, int) and d >= 0 for d in shape)
                      and isinstance(begin, int) and isinstance(end, int) and 0 <= begin <= end)
            except (KeyError, TypeError, ValueError):
                ok = False
            if not ok:
                raise SafetensorsError(f"{self.path}: corrupt safetensors file (bad header entry for {name!r})")
            nbytes = math.prod(shape) * ITEMSIZE[dtype]
            if end - begin != nbytes:
                raise SafetensorsError(f"{self.path}: corrupt safetensors file ({name}: {end - begin} bytes for "
                                       f"{dtype} {list(shape)}, which needs {nbytes})")
            tensors[name] = TensorInfo(name, dtype, shape, base + begin, nbytes)
            data_end = max(data_end, end)
        if base + data_end > self.size:
            raise SafetensorsError(f"{self.path}: truncated safetensors file ({self.size} bytes, its header "
                                   f"needs {base + data_end})")
        return tensors, metadata

    def _pread(self, offset: int, nbytes: int) -> bytes:
        return os.pread(self._fh.fileno(), nbytes, offset)

    def _read_into(self, offset: int, out: torch.Tensor) -> None:
        view = memoryview(out.numpy()).cast("B")
        done = 0
        while done < len(view):
            try:
                got = os.preadv(self._fh.fileno(), [view[done:]], offset + done)
            except OSError as exc:
                raise SafetensorsError(f"{self.path}: read error ({exc.strerror})") from None
            if got == 0:
                raise SafetensorsError(f"{self.path}: truncated safetensors file (short read at byte {offset + done})")
            done += got

    def keys(self) -> list[str]:
        return list(self.tensors)

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def read(self, name: str) -> torch.Tensor:
        """The whole tensor, freshly allocated (no mapping of the file stays behind)."""
        t = self.tensors[name]
        return self._read_range(t, t.start, t.nbytes, t.shape)

    def read_rows(self, name: str, start: int, count: int = 1) -> torch.Tensor:
        """Rows [start, start+count) along the first dimension: one contiguous read."""
        t = self.tensors[name]
        if not t.shape or not 0 <= start <= start + count <= t.shape[0]:
            raise IndexError(f"{name}: rows {start}..{start + count} outside {list(t.shape)}")
        row = t.nbytes // t.shape[0] if t.shape[0] else 0
        return self._read_range(t, t.start + start * row, count * row, (count, *t.shape[1:]))

    def _read_range(self, t: TensorInfo, offset: int, nbytes: int, shape: tuple[int, ...]) -> torch.Tensor:
        raw = torch.empty(nbytes, dtype=torch.uint8)
        if nbytes:
            self._read_into(offset, raw)
        return raw.view(t.torch_dtype).reshape(shape)

    def close(self) -> None:
        self._fh.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


@dataclass(frozen=True)
class TensorEntry:
    """A tensor to be written: its name, safetensors dtype and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZE[self.dtype]


def _group_alignment(group: list[TensorEntry]) -> int:
    """The alignment a group keeps: its first tensor's item size, reduced to what its length preserves."""
    total = sum(e.nbytes for e in group)
    align = ITEMSIZE[group[0].dtype]
    while align > 1 and total % align:
        align //= 2
    return align


def plan_safetensors(groups: list[list[TensorEntry]], metadata: dict[str, str] | None = None) -> tuple[list[list[TensorEntry]], bytes, dict[str, tuple[int, int]]]:
    """File order, header bytes and data offsets for tensors written group by group.

    Tensors of one group (a quantized weight with its scales and biases) stay adjacent so they can
    be produced together; groups are ordered by the alignment they keep, then by name, so every
    tensor starts on a multiple of its item size."""
    groups = [g for g in groups if g]
    order = sorted(groups, key=lambda g: (-_group_alignment(g), g[0].name))
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    offsets, pos = {}, 0
    for group in order:
        for e in group:
            if e.name in offsets:
                raise ValueError(f"tensor {e.name} planned twice")
            offsets[e.name] = (pos, pos + e.nbytes)
            header[e.name] = {"dtype": e.dtype, "shape": list(e.shape), "data_offsets": [pos, pos + e.nbytes]}
            pos += e.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
    blob += b" " * (-(8 + len(blob)) % 8)  # data starts 8-byte aligned
    return order, struct.pack("<Q", len(blob)) + blob, offsets


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """The raw bytes of a CPU tensor (little-endian machines only, like safetensors itself)."""
    t = t.detach().contiguous().cpu()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy()).cast("B")
