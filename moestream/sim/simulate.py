"""Replay a routing trace through a slot pool and a policy: the hit rate a cache size would get.

Pure Python over the same SlotDirectory the engine uses, so a simulated policy decides exactly as
the real cache would for the same sequence of requests (without early reads). The device-driven
path's rules (device-cycle, device-lru) run the engine's own DeviceMap on the CPU (torch ops, one
byte per record: DeviceMap.synthetic)."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.experts.directory import SlotDirectory
from moestream.experts.trace import RoutingTrace


@dataclass
class SimResult:
    policy: str
    slots: int
    hits: int
    misses: int

    @property
    def hit_rate(self) -> float:
        total = self.hits + self.misses
        return self.hits / total if total else 1.0


def simulate(trace: RoutingTrace, *, slots: int, policy: str = "clock") -> SimResult:
    directory = SlotDirectory(slots, policy=policy)
    hits = misses = 0
    # one token's experts in one layer are pinned together, then released: as the engine does
    for layer, row in zip(trace.layer.tolist(), trace.experts.tolist()):
        keys = [(layer, e) for e in sorted(set(row))]
        for key in keys:
            if directory.lookup(key) is not None:
                directory.touch(key)
                hits += 1
            else:
                directory.reserve(key)
                directory.mark_ready(key)
                misses += 1
            directory.pin(key)
        for key in keys:
            directory.unpin(key)
    return SimResult(policy, slots, hits, misses)


def total_experts(trace: RoutingTrace) -> int:
    meta = trace.meta
    return int(meta.get("num_experts", int(trace.experts.max()) + 1)) * len(set(trace.layer.tolist()))


DEVICE_POLICIES = {"device-cycle": "cycle", "device-lru": "lru"}


def simulate_device(trace: RoutingTrace, *, slots: int, policy: str = "device-cycle") -> SimResult:
    """The trace through the device map (moestream.experts.device_map) with `policy`'s rule, one lookup
    per row (a token's experts in one layer), as the engine counts decoding one token a step."""
    import torch

    from moestream.errors import MoestreamError
    from moestream.experts.device_map import DeviceMap, DeviceMapUnavailable

    moe_layers = sorted(set(trace.layer.tolist()))
    experts = int(trace.meta.get("num_experts", int(trace.experts.max()) + 1))
    try:
        dm = DeviceMap.synthetic(moe_layers, experts, slots, policy=DEVICE_POLICIES[policy])
    except DeviceMapUnavailable as exc:
        raise MoestreamError(f"{policy} at {slots} slots: {exc}") from None
    rows = torch.from_numpy(trace.experts.astype("int64"))
    with torch.inference_mode():
        for i, layer in enumerate(trace.layer.tolist()):
            dm.ensure(layer, rows[i:i + 1])
    return SimResult(policy, slots, *dm.totals())
