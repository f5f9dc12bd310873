"""Write a packed model back out as a float Hugging Face checkpoint (per-expert tensor names, or
fused `experts.gate_up_proj` / `experts.down_proj` stacks where the family sets
EXPERT_EXPORT = "fused"; a family's `checkpoint_name` undoes its sanitize's renaming), so transformers can run exactly the weights moestream runs: the
reference for quantized models."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from moestream.convert.layout import fused_layout
from moestream.format.reader import PackedModel
from moestream.models.registry import family_module


def _fused_stacks(experts: list[dict[str, torch.Tensor]], layout) -> dict[str, torch.Tensor]:
    """One layer's experts as the fused stacks `layout` (convert.layout.FusedLayout) describes."""
    def join(gate, up):  # [I, ...] twice -> [2I, ...]
        return torch.stack([gate, up], 1).flatten(0, 1) if layout.interleaved else torch.cat([gate, up])

    gate_up = torch.stack([join(w["gate_proj"], w["up_proj"]) for w in experts])  # [E, 2I, H]
    down = torch.stack([w["down_proj"] for w in experts])  # [E, H, I]
    if layout.transposed:
        gate_up, down = gate_up.transpose(1, 2), down.transpose(1, 2)
    out = {"gate_up_proj": gate_up.contiguous(), "down_proj": down.contiguous()}
    if layout.bias:
        out["gate_up_proj_bias"] = torch.stack([join(w["gate_proj.bias"], w["up_proj.bias"]) for w in experts]).contiguous()
        out["down_proj_bias"] = torch.stack([w["down_proj.bias"] for w in experts]).contiguous()
    return out


def export_hf(packed_dir: str | Path, out_dir: str | Path, *, dtype: torch.dtype = torch.float32) -> Path:
    packed = PackedModel(packed_dir)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    family = family_module(packed.family)  # experts are named as the family's checkpoints name them
    args = family.ModelArgs.from_dict(packed.config)
    # the multi-token-prediction layers are left out: transformers does not run them
    tensors = {name: packed.dense(name, dtype).contiguous() for name in packed.logical_dense_names()
               if not args.is_mtp_weight(name)}
    module, names = family.EXPERT_MODULE, family.EXPERT_NAMES
    fused = getattr(family, "EXPERT_EXPORT", "per_expert") == "fused" or hasattr(family, "EXPERT_FUSED")
    for entry in packed.manifest.expert_layers:
        if entry.layer >= args.num_hidden_layers:
            continue
        prefix = f"model.layers.{entry.layer}." + (f"{module}." if module else "")
        experts = [packed.dequantized_expert(entry.layer, e, dtype) for e in range(entry.num_experts)]
        if fused:  # [E, 2I, H] gate rows then up rows, and [E, H, I], or as the family's FusedLayout says
            layout = fused_layout(family)
            if layout.bias:
                for e, w in enumerate(experts):
                    record = packed.expert_tensors(entry.layer, e)
                    w.update({f"{p}.bias": record[f"{p}.bias"].to(dtype) for p in ("gate_proj", "up_proj", "down_proj")})
            tensors.update({prefix + "experts." + k: t for k, t in _fused_stacks(experts, layout).items()})
            continue
        for e, weights in enumerate(experts):
            for proj, w in weights.items():
                tensors[f"{prefix}experts.{e}.{names[proj]}.weight"] = w.contiguous()
    rename = getattr(family, "checkpoint_name", None)  # packed name -> the checkpoint's, where they differ
    if rename is not None:
        tensors = {rename(name): t for name, t in tensors.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = dict(packed.config)
    config.pop("quantization", None)
    config.pop("quantization_config", None)
    config["torch_dtype"] = config["dtype"] = str(dtype).replace("torch.", "")
    (out / "config.json").write_text(json.dumps(config, indent=1))
    for name in packed.manifest.files:
        if not name.endswith((".bin", ".safetensors")):
            shutil.copyfile(packed.directory / name, out / name)
    return out
