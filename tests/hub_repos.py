"""Test repositories for the local Hub: a tiny checkpoint re-saved as several shards with an index."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from tiny import load_all


def shard_checkpoint(src: Path, dst: Path, shards: int) -> Path:
    """`src`'s tensors in name order, cut into `shards` files of about equal bytes, each cut inside
    an expert (so layers' experts, and experts' projections, straddle two shards), plus the index."""
    dst.mkdir(parents=True, exist_ok=True)
    for p in src.iterdir():
        if p.is_file() and not p.name.endswith(".safetensors") and p.name != "model.safetensors.index.json":
            shutil.copy(p, dst / p.name)
    tensors = load_all(src)
    names = sorted(tensors)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    groups, current, size = [], [], 0
    for name in names:
        current.append(name)
        size += tensors[name].numel() * tensors[name].element_size()
        # cut inside an expert (its down_proj sorts first), so its projections straddle two shards
        inside_expert = ".experts." in name and name.endswith("down_proj.weight")
        if size >= total * (len(groups) + 1) / shards and len(groups) < shards - 1 and inside_expert:
            groups.append(current)
            current = []
    groups.append(current)
    weight_map = {}
    for i, group in enumerate(groups):
        file = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(dst / file), metadata={"format": "pt"})
        weight_map.update({n: file for n in group})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                 "weight_map": weight_map}, indent=1))
    return dst
