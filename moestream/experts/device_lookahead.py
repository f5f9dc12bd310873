"""Lookahead copies on the device-driven path: the next MoE layers' likely experts, copied while a
layer computes.

On the host path the decoder hands its guesses (the next layers' routers applied to a layer's
expert input, moestream.experts.predict) to the host with the layer's ids. On the device-driven
path (moestream.experts.device_map) nothing goes to the host, so the guesses stay on the device
too: once a layer's own misses are queued, a side stream looks the guessed experts up in the
device map and copies the missing ones, beside the layer's expert kernels, and the layer waits
for it before it returns (the fork and the join stay within one layer's work, so any CUDA graph
that holds the layer holds both). The map never evicts a slot of the layer being computed for them:
its experts carry the newest stamps and the pool has at least twice a layer's experts.

Each guess is scored when its layer routes (the share of the layer's experts it named, counted on
the device). Every SCORE_EVERY steps the host reads the counts and closes, per target layer, the
gate of guesses whose accuracy (a moving average) is below `min_accuracy`: then the lookup of a
guess withholds every miss (no copies, nothing evicted). Under routing the router does not predict
(a benchmark's uniform draw) the guesses cost no bandwidth after the first check. Guesses change
what sits in the slots, never the output."""
from __future__ import annotations

import torch

SCORE_EVERY = 16  # steps between the host's reads of the accuracy counts
OPEN, CLOSED = 0, 1024  # a gate is a share of the misses withheld (moestream.experts.device_map.ensure)


class DeviceLookahead:
    def __init__(self, device_map, targets: dict[int, int], *, depth: int, min_accuracy: float = 0.3,
                 decay: float = 0.9):
        """targets: MoE layer -> experts a guess of it names (its router's top-k)."""
        dev = device_map.pool.device
        self.dm, self.depth, self.min_accuracy, self.decay = device_map, depth, min_accuracy, decay
        self.cuda = dev.type == "cuda"
        self.layers = sorted(targets)
        self._index = {layer: i for i, layer in enumerate(self.layers)}
        n, most = len(self.layers), max(targets.values())
        self.guess = torch.full((n, most), -1, dtype=torch.int64, device=dev)  # the pending guess of each layer
        self.pending = torch.zeros(n, dtype=torch.int64, device=dev)  # 1 where a guess waits for its layer
        self.right = torch.zeros(n, dtype=torch.int64, device=dev)  # experts guessed right, per target layer
        self.named = torch.zeros(n, dtype=torch.int64, device=dev)  # experts guessed
        self.gate_host = torch.full((n,), OPEN, dtype=torch.int32)
        if self.cuda:
            from moestream.experts.uva import device_view

            self.gate_host = self.gate_host.pin_memory()
            view = device_view(self.gate_host.view(torch.uint8))
            if view is None:
                raise RuntimeError("this GPU cannot read pinned host memory at its address")
            self.gate = view.view(torch.int32)
            self.side = torch.cuda.Stream(dev)
        else:
            self.gate = self.gate_host
            self.side = None
        self.ema: dict[int, float] = {}
        self._seen = (torch.zeros(n, dtype=torch.int64), torch.zeros(n, dtype=torch.int64))
        self.steps = 0

    # -- on the device, inside a layer's work -------------------------------------------------------
    def score(self, layer: int, ids: torch.Tensor) -> None:
        """`layer` routes to `ids` (before its lookup): count what its pending guess named right."""
        i = self._index.get(layer)
        if i is None:
            return
        if ids.shape[0] != 1:  # guesses are made for one-token steps: a longer step scores none
            self.pending[i].fill_(0)
            return
        flat, guess = ids.reshape(-1), self.guess[i]
        right = (flat[:, None] == guess[None, :]).any(1).sum()  # one token's ids are distinct
        self.right[i] += right * self.pending[i]
        self.named[i] += (guess >= 0).sum() * self.pending[i]
        self.pending[i].fill_(0)

    def fork(self, ahead: list[tuple[int, torch.Tensor]]) -> None:
        """After a layer's own lookup: look up and copy the guessed experts of later layers
        (`ahead`: (layer, guessed ids [k])) on the side stream."""
        if self.side is not None:
            self.side.wait_stream(torch.cuda.current_stream(self.side.device))
            with torch.cuda.stream(self.side):
                self._guess(ahead)
        else:
            self._guess(ahead)

    def _guess(self, ahead: list[tuple[int, torch.Tensor]]) -> None:
        for layer, ids in ahead:
            i = self._index[layer]
            flat = ids.reshape(-1)
            self.guess[i, :flat.numel()].copy_(flat)
            self.pending[i].fill_(1)
            self.dm.ensure(layer, flat, withhold=self.gate[i:i + 1], count=False, keep_one=False)

    def join(self) -> None:
        """Before the layer returns: its stream waits for the early copies (the next lookup reads the map)."""
        if self.side is not None:
            torch.cuda.current_stream(self.side.device).wait_stream(self.side)

    # -- on the host, between steps --------------------------------------------------------------------
    def after_step(self) -> None:
        """Every SCORE_EVERY steps: read the counts (one sync) and open or close each layer's gate."""
        self.steps += 1
        if self.steps % SCORE_EVERY:
            return
        right, named = self.right.cpu(), self.named.cpu()
        new_right, new_named = right - self._seen[0], named - self._seen[1]
        self._seen = (right, named)
        for i, layer in enumerate(self.layers):
            if int(new_named[i]) == 0:
                continue
            acc = int(new_right[i]) / int(new_named[i])
            self.ema[layer] = acc if layer not in self.ema else self.decay * self.ema[layer] + (1 - self.decay) * acc
            self.gate_host[i] = OPEN if self.ema[layer] >= self.min_accuracy else CLOSED

    def stats(self) -> dict:
        right, named = self.right.tolist(), self.named.tolist()
        per_layer = {str(layer): round(right[i] / named[i], 4) for i, layer in enumerate(self.layers) if named[i]}
        total = sum(named)
        # a layer's pending guess is the latest made for it (one layer ahead): what is scored
        return {"path": "device", "depth": self.depth, "min_accuracy": self.min_accuracy,
                "accuracy": {"depth1": round(sum(right) / total, 4) if total else None},
                "accuracy_per_layer": {f"{k}@1": v for k, v in per_layer.items()},
                "closed_layers": [layer for i, layer in enumerate(self.layers) if int(self.gate_host[i]) == CLOSED]}
