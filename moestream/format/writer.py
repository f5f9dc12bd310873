"""Write a packed model: resident tensors (streamed), expert records (as they are made), manifest last.

Every output file is hashed while it is written, so finishing a model needs no second pass over
its bytes, and a full disk surfaces as one line naming the file."""
from __future__ import annotations

import errno
import hashlib
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from moestream.errors import MoestreamError
from moestream.format.integrity import sha256_file
from moestream.format.manifest import DENSE_NAME, EXPERT_PROJECTIONS, ExpertLayer, Manifest, write_manifest
from moestream.format.records import encode_record, plan_record
from moestream.format.safetensors_io import DTYPE_NAMES, TensorEntry, plan_safetensors, tensor_bytes
from moestream.quant.affine import QuantSpec, quantize


class WriteError(MoestreamError):
    """Writing the packed model failed (disk full, permissions, I/O error)."""


def write_error(path: Path, exc: OSError) -> WriteError:
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return WriteError(f"no space left on device writing {path}")
    return WriteError(f"cannot write {path}: {exc.strerror or exc}")


@dataclass(frozen=True)
class FileDigest:
    size: int
    sha256: str

    @staticmethod
    def of(path: Path) -> "FileDigest":
        return FileDigest(path.stat().st_size, sha256_file(path))

    def to_json(self) -> dict:
        return {"sha256": self.sha256, "size": self.size}


class OutputFile:
    """A file being written from the start: hashed as it goes, fsynced on close."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self._fh = open(self.path, "wb")
        except OSError as exc:
            raise write_error(self.path, exc) from None
        self._sha = hashlib.sha256()
        self.size = 0

    def _write_raw(self, data) -> None:
        self._fh.write(data)

    def write(self, data) -> None:
        try:
            self._write_raw(data)
        except OSError as exc:
            self.abort()
            raise write_error(self.path, exc) from None
        self._sha.update(data)
        self.size += len(data)

    def close(self) -> FileDigest:
        try:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        except OSError as exc:
            self.abort()
            raise write_error(self.path, exc) from None
        return FileDigest(self.size, self._sha.hexdigest())

    def abort(self) -> None:
        try:
            self._fh.close()
        except OSError:
            pass


class SafetensorsWriter:
    """Writes a safetensors file whose header is known up front, then its tensors one by one.

    `order` lists the groups in the order their tensors must be written."""

    def __init__(self, path: str | os.PathLike, groups: list[list[TensorEntry]], metadata: dict[str, str] | None = None):
        self.order, header, _ = plan_safetensors(groups, metadata)
        self._queue = [e for g in self.order for e in g]
        self._next = 0
        self._out = OutputFile(path)
        self._out.write(header)

    @property
    def path(self) -> Path:
        return self._out.path

    def _expect(self, name: str) -> TensorEntry:
        if self._next >= len(self._queue) or self._queue[self._next].name != name:
            expected = self._queue[self._next].name if self._next < len(self._queue) else "nothing"
            raise ValueError(f"{self.path}: {name} written out of order (expected {expected})")
        return self._queue[self._next]

    def write(self, name: str, tensor: torch.Tensor) -> None:
        entry = self._expect(name)
        if tuple(tensor.shape) != entry.shape:
            raise ValueError(f"{self.path}: {name} is {list(tensor.shape)}, the header says {list(entry.shape)}")
        self.write_blocks(name, [tensor])

    def write_blocks(self, name: str, blocks) -> None:
        """One tensor given as consecutive row blocks (e.g. read piecewise from a source file)."""
        entry, written = self._expect(name), 0
        for block in blocks:
            if DTYPE_NAMES.get(block.dtype) != entry.dtype:
                raise ValueError(f"{self.path}: {name} block is {DTYPE_NAMES.get(block.dtype)}, the header says {entry.dtype}")
            data = tensor_bytes(block)
            written += len(data)
            if written > entry.nbytes:
                break
            self._out.write(data)
        if written != entry.nbytes:
            raise ValueError(f"{self.path}: {name} got {written} bytes, the header says {entry.nbytes}")
        self._next += 1

    def close(self) -> FileDigest:
        if self._next != len(self._queue):
            self._out.abort()
            raise ValueError(f"{self.path}: {len(self._queue) - self._next} tensors were never written")
        return self._out.close()

    def abort(self) -> None:
        self._out.abort()


def save_safetensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> FileDigest:
    """A dict of tensors to a safetensors file through the streaming writer."""
    groups = [[TensorEntry(n, DTYPE_NAMES[t.dtype], tuple(t.shape))] for n, t in tensors.items()]
    writer = SafetensorsWriter(path, groups, metadata)
    for group in writer.order:
        for e in group:
            writer.write(e.name, tensors[e.name])
    return writer.close()


def stored_tensors(name: str, tensor: torch.Tensor, spec: QuantSpec) -> dict[str, torch.Tensor]:
    """How one logical tensor is stored: itself, or MLX-style `.weight/.scales/.biases`."""
    if not spec.quantized:
        return {name: tensor.contiguous()}
    base = name[: -len(".weight")]
    weight, scales, biases = quantize(tensor, spec.bits, spec.group_size)
    return {name: weight, base + ".scales": scales, base + ".biases": biases}


def expert_record_tensors(projections: dict[str, torch.Tensor], specs: dict[str, QuantSpec]) -> dict[str, torch.Tensor]:
    """{gate_proj: [I, H], ...} float -> the record's named tensors in a fixed order."""
    out = {}
    for proj in EXPERT_PROJECTIONS:
        out.update(stored_tensors(f"{proj}.weight", projections[proj], specs[proj]))
    return out


class ExpertFileWriter:
    """Appends the records of one layer, in expert order, to its file."""

    def __init__(self, path: Path, layer: int, num_experts: int, first: dict[str, torch.Tensor],
                 quant: dict[str, QuantSpec]):
        self.path = Path(path)
        fields, record_size = plan_record(first)
        self.entry = ExpertLayer(layer=layer, file=self.path.name, num_experts=num_experts, record_size=record_size,
                                 fields=fields, quant={k: v.to_json() for k, v in quant.items()})
        self._out = OutputFile(self.path)
        self.digest: FileDigest | None = None

    def write(self, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        written = len(self.entry.crc32)
        if expert != written:
            raise ValueError(f"layer {self.entry.layer}: expert {expert} written out of order (expected {written})")
        record = encode_record(self.entry.fields, self.entry.record_size, tensors)
        self._out.write(record)
        self.entry.crc32.append(zlib.crc32(record))

    def close(self) -> ExpertLayer:
        if len(self.entry.crc32) != self.entry.num_experts:
            self._out.abort()
            raise ValueError(f"layer {self.entry.layer}: {len(self.entry.crc32)} of {self.entry.num_experts} experts written")
        self.digest = self._out.close()
        return self.entry

    def abort(self) -> None:
        self._out.abort()


def finish_model(directory: Path, *, family: str, config: dict, source: dict, quantization: dict,
                 dense: dict[str, torch.Tensor], expert_layers: list[ExpertLayer], extra_files: list[str]) -> Manifest:
    """Write the resident tensors, hash every file, then the manifest (last, atomically)."""
    directory = Path(directory)
    digests = {DENSE_NAME: save_safetensors(directory / DENSE_NAME, dense, {"format": "pt"})}
    names = [e.file for e in expert_layers] + list(extra_files)
    files = {DENSE_NAME: digests[DENSE_NAME].to_json()}
    files.update({n: FileDigest.of(directory / n).to_json() for n in names})
    manifest = Manifest(family=family, config=config, source=source, quantization=quantization,
                        expert_layers=sorted(expert_layers, key=lambda e: e.layer), files=files)
    write_manifest(directory, manifest)
    return manifest
