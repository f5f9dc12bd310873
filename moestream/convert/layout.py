"""Where a checkpoint keeps its routed experts: per-expert tensors, fused 3-D stacks, or MLX stacks.

Each layout answers: which tensor names are expert weights, and given (layer, expert) the three
projections as float [out, in] matrices (or already-quantized MLX parts)."""
from __future__ import annotations

import re

# Mixtral's w1/w3/w2 are gate/up/down.
PROJ_ALIASES = {"gate_proj": "gate_proj", "up_proj": "up_proj", "down_proj": "down_proj",
                "w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

PER_EXPERT = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.experts\.(?P<expert>\d+)\."
                        r"(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
FUSED = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.experts\.(?P<part>gate_up_proj|down_proj)(?:\.weight)?$")
MLX_STACK = re.compile(r"^(?P<prefix>.*layers\.(?P<layer>\d+)\.(?:mlp|block_sparse_moe))\.switch_mlp\."
                       r"(?P<proj>gate_proj|up_proj|down_proj)\.(?P<part>weight|scales|biases)$")


def expert_layer_of(name: str) -> int | None:
    """The layer index if `name` is a routed-expert tensor in any known layout, else None."""
    for pattern in (PER_EXPERT, FUSED, MLX_STACK):
        m = pattern.match(name)
        if m:
            return int(m.group("layer"))
    return None
