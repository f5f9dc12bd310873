"""Write a packed model: resident tensors, expert records (as they are made) and the manifest last."""
from __future__ import annotations

import hashlib
import os
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from moestream.format.manifest import DENSE_NAME, ExpertLayer, Manifest, write_manifest
from moestream.format.records import encode_record, plan_record
from moestream.quant.affine import QuantSpec, quantize


def sha256_file(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            digest.update(block)
    return digest.hexdigest()


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
    for proj in ("gate_proj", "up_proj", "down_proj"):
        out.update(stored_tensors(f"{proj}.weight", projections[proj], specs[proj]))
    return out


class ExpertFileWriter:
    """Appends the records of one layer, in expert order, to its file."""

    def __init__(self, path: Path, layer: int, num_experts: int, first: dict[str, torch.Tensor],
                 quant: dict[str, QuantSpec]):
        self.path = path
        fields, record_size = plan_record(first)
        self.entry = ExpertLayer(layer=layer, file=path.name, num_experts=num_experts, record_size=record_size,
                                 fields=fields, quant={k: v.to_json() for k, v in quant.items()})
        self._fh = open(path, "wb")
        self._next = 0

    def write(self, expert: int, tensors: dict[str, torch.Tensor]) -> None:
        if expert != self._next:
            raise ValueError(f"layer {self.entry.layer}: expert {expert} written out of order (expected {self._next})")
        record = encode_record(self.entry.fields, self.entry.record_size, tensors)
        self._fh.write(record)
        self.entry.crc32.append(zlib.crc32(record))
        self._next += 1

    def close(self) -> ExpertLayer:
        if self._next != self.entry.num_experts:
            raise ValueError(f"layer {self.entry.layer}: {self._next} of {self.entry.num_experts} experts written")
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return self.entry


def finish_model(directory: Path, *, family: str, config: dict, source: dict, quantization: dict,
                 dense: dict[str, torch.Tensor], expert_layers: list[ExpertLayer], extra_files: list[str]) -> Manifest:
    """Write the resident tensors, hash every file, then the manifest (last, atomically)."""
    save_file(dense, str(directory / DENSE_NAME), metadata={"format": "pt"})
    names = [DENSE_NAME] + [e.file for e in expert_layers] + list(extra_files)
    files = {n: {"sha256": sha256_file(directory / n), "size": (directory / n).stat().st_size} for n in names}
    manifest = Manifest(family=family, config=config, source=source, quantization=quantization,
                        expert_layers=sorted(expert_layers, key=lambda e: e.layer), files=files)
    write_manifest(directory, manifest)
    return manifest
