"""An ExpertProvider that keeps every expert record on the compute device (no cache, never misses)."""
from __future__ import annotations

from typing import Sequence

import torch

from moestream.format.reader import PackedModel
from moestream.format.records import decode_record
from moestream.quant.affine import QuantSpec


class ResidentExperts:
    def __init__(self, packed: PackedModel, device: torch.device):
        self.fields, self.records, self._quant = {}, {}, {}
        for entry in packed.manifest.expert_layers:
            raw = (packed.directory / entry.file).read_bytes()
            data = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(entry.num_experts, entry.record_size)
            self.records[entry.layer] = data.to(device)
            self.fields[entry.layer] = entry.fields
            self._quant[entry.layer] = {p: QuantSpec.from_json(s) for p, s in entry.quant.items()}
        self.bytes_resident = sum(r.numel() for r in self.records.values())

    def quant(self, layer: int) -> dict[str, QuantSpec]:
        return self._quant[layer]

    def fetch(self, layer: int, experts: Sequence[int]) -> dict[int, dict[str, torch.Tensor]]:
        return {e: decode_record(self.fields[layer], self.records[layer][e]) for e in experts}

    def release(self, layer: int) -> None:
        pass

    def batch_limit(self, layer: int) -> int:
        return len(self.records[layer])

    def stats(self) -> dict:
        return {"source": "resident", "hit_rate": 1.0, "misses": 0, "bytes_read_disk": 0, "bytes_read_host": 0,
                "read_wait_s": 0.0, "slot_bytes": self.bytes_resident}
