"""Routing traces: which experts each token chose in each MoE layer, stored compactly (.npz).

Arrays: `layer` int16 [N], `position` int32 [N], `experts` int16 [N, A]; `meta` a JSON string
(model, family, num_experts per layer, top_k, moe_layers). One row per (token, MoE layer)."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


@dataclass
class RoutingTrace:
    layer: np.ndarray
    position: np.ndarray
    experts: np.ndarray
    meta: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return int(self.layer.shape[0])

    def save(self, path: str | Path) -> None:
        np.savez_compressed(path, layer=self.layer, position=self.position, experts=self.experts,
                            meta=np.array(json.dumps(self.meta)))

    @staticmethod
    def load(path: str | Path) -> "RoutingTrace":
        with np.load(path, allow_pickle=False) as data:
            return RoutingTrace(data["layer"], data["position"], data["experts"], json.loads(str(data["meta"])))


class TraceRecorder:
    """Collects rows during a run; `to_trace()` packs them."""

    def __init__(self, meta: dict):
        self.meta = meta
        self._layers, self._positions, self._experts = [], [], []

    def record(self, layer: int, start, ids) -> None:
        """ids [T, A] at positions start.. (an int), or at the given positions (a list: rows of a
        step of several sequences)."""
        ids = np.asarray(ids, dtype=np.int16)  # [T, A]
        self._layers.append(np.full(ids.shape[0], layer, dtype=np.int16))
        if isinstance(start, int):
            self._positions.append(np.arange(start, start + ids.shape[0], dtype=np.int32))
        else:
            self._positions.append(np.asarray(start, dtype=np.int32))
        self._experts.append(ids)

    def to_trace(self) -> RoutingTrace:
        if not self._layers:
            top_k = self.meta.get("top_k", 1)
            return RoutingTrace(np.zeros(0, np.int16), np.zeros(0, np.int32), np.zeros((0, top_k), np.int16), self.meta)
        layer = np.concatenate(self._layers)
        position = np.concatenate(self._positions)
        experts = np.concatenate(self._experts)
        order = np.lexsort((layer, position))  # token-major, as a decode would ask
        return RoutingTrace(layer[order], position[order], experts[order], self.meta)
