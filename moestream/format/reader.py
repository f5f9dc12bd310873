"""Open a packed model: the manifest, resident tensors and expert records."""
from __future__ import annotations

import ctypes
import mmap
import os
import sys
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from moestream.errors import FormatError
from moestream.format.manifest import DENSE_NAME, EXPERT_PROJECTIONS, ExpertLayer, Manifest, read_manifest
from moestream.format.records import decode_record
from moestream.quant import mxfp4
from moestream.quant.affine import QuantSpec, dequantize


class PackedModel:
    """A packed model directory. Cheap to open: tensors are read on demand."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self.manifest: Manifest = read_manifest(self.directory)
        self._check_files()
        try:
            self._dense = safe_open(str(self.directory / DENSE_NAME), framework="pt")
        except (SafetensorError, OSError) as exc:
            raise FormatError(f"{self.directory / DENSE_NAME}: unreadable ({exc})") from None
        self.dense_names = set(self._dense.keys())

    # -- metadata -------------------------------------------------------------
    @property
    def config(self) -> dict:
        return self.manifest.config

    @property
    def family(self) -> str:
        return self.manifest.family

    def _check_files(self) -> None:
        for name, info in self.manifest.files.items():
            path = self.directory / name
            if not path.is_file():
                raise FormatError(f"{path}: missing (the model directory is incomplete)")
            size = path.stat().st_size
            if size != info["size"]:
                kind = "truncated" if size < info["size"] else "longer than recorded"
                raise FormatError(f"{path}: {kind} ({size} bytes, manifest says {info['size']})")
        from moestream.format.verify import check_layout

        for entry in self.manifest.expert_layers:
            problems = check_layout(entry, checksums=False)  # the record sources check those, when they verify
            if problems:
                raise FormatError(f"{self.directory / 'moestream.json'}: {problems[0]}")
            expected = entry.num_experts * entry.record_size
            try:
                size = (self.directory / entry.file).stat().st_size
            except OSError as exc:
                raise FormatError(f"{self.directory / entry.file}: {exc.strerror} (layer {entry.layer}'s expert file)") from None
            if size != expected:
                raise FormatError(f"{self.directory / entry.file}: {size} bytes, but {entry.num_experts} records of "
                                  f"{entry.record_size} bytes need {expected}")

    def expert_layer(self, layer: int) -> ExpertLayer:
        entry = self.manifest.expert_layer(layer)
        if entry is None:
            raise KeyError(f"layer {layer} has no routed experts")
        return entry

    # -- resident tensors -----------------------------------------------------
    def tensor_spec(self, name: str) -> QuantSpec:
        return QuantSpec.from_json(self.manifest.quantization["tensors"].get(name))

    def raw_dense(self, name: str) -> torch.Tensor:
        if name not in self.dense_names:
            raise FormatError(f"{self.directory / DENSE_NAME}: tensor {name!r} is missing")
        return self._dense.get_tensor(name)

    def dense(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A resident tensor by its checkpoint name (`...q_proj.weight`), dequantized if stored quantized."""
        spec = self.tensor_spec(name)
        if not spec.quantized:
            t = self.raw_dense(name)
            return t if dtype is None else t.to(dtype)
        base = name[: -len(".weight")]
        raw = [self.raw_dense(n) for n in (name, base + ".scales", base + ".biases")]
        out = dequantize(*raw, spec.bits, spec.group_size, dtype or torch.float32)
        for t in raw:  # read once: their pages of the file's mapping need not stay in RAM beside the copy
            _release_pages(t)
        return out

    def logical_dense_names(self) -> list[str]:
        """Names of resident tensors as the checkpoint had them (quantized ones once, as `.weight`)."""
        quantized = {n[: -len(".weight")] for n, s in self.manifest.quantization["tensors"].items() if s}
        return sorted(n for n in self.dense_names
                      if not (n.endswith((".scales", ".biases")) and n.rsplit(".", 1)[0] in quantized))

    # -- expert records -------------------------------------------------------
    def read_record(self, layer: int, expert: int) -> bytes:
        entry = self.expert_layer(layer)
        if not 0 <= expert < entry.num_experts:
            raise IndexError(f"layer {layer} has {entry.num_experts} experts, not {expert}")
        with open(self.directory / entry.file, "rb") as fh:
            fh.seek(expert * entry.record_size)
            data = fh.read(entry.record_size)
        if len(data) != entry.record_size:
            raise FormatError(f"{self.directory / entry.file}: short read of layer {layer} expert {expert}")
        return data

    def expert_tensors(self, layer: int, expert: int) -> dict[str, torch.Tensor]:
        """The record's stored tensors (`gate_proj.weight`, `gate_proj.scales`, ...)."""
        record = torch.frombuffer(bytearray(self.read_record(layer, expert)), dtype=torch.uint8)
        return decode_record(self.expert_layer(layer).fields, record)

    def dequantized_expert(self, layer: int, expert: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """{gate_proj, up_proj, down_proj} -> float [out, in] matrices."""
        return dequantize_record(self.expert_layer(layer), self.expert_tensors(layer, expert), dtype)


def dequantize_record(entry: ExpertLayer, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    out = {}
    for proj in EXPERT_PROJECTIONS:
        spec = QuantSpec.from_json(entry.quant[proj])
        if spec.mode == mxfp4.MODE:
            out[proj] = mxfp4.dequantize_matrix(tensors[f"{proj}.weight"], tensors[f"{proj}.scales"], dtype)
        elif spec.quantized:
            out[proj] = dequantize(tensors[f"{proj}.weight"], tensors[f"{proj}.scales"], tensors[f"{proj}.biases"],
                                   spec.bits, spec.group_size, dtype)
        else:
            out[proj] = tensors[f"{proj}.weight"].to(dtype)
    return out


_MADV_DONTNEED = 4
_libc = None


def _release_pages(t: torch.Tensor) -> None:
    """Drop the whole pages under `t` (a view into the safetensors file's private mapping, never
    written) from this process's RAM; touched again, they are read again from the file."""
    global _libc
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    first, last = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE, end // mmap.PAGESIZE * mmap.PAGESIZE
    if t.device.type != "cpu" or last <= first or not sys.platform.startswith("linux"):
        return
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    _libc.madvise(first, last - first, _MADV_DONTNEED)  # advice: a failure only keeps the pages

