"""Find a family's module by config.json's model_type (one file per family, loaded on demand).

What the project asks of a family module (each file in moestream/models/ has all of it):
  ModelArgs        dataclass read from config.json (`ModelArgs.from_dict`), with `is_moe_layer(i)`,
                   `moe_layers()`, `expert_shapes()`, `kv_layout()`, `largest_intermediate()` and
                   EXPERT_INTERMEDIATE (the config field sizing routed experts)
  EXPERT_MODULE    the module holding routed experts in checkpoint names ("mlp", "block_sparse_moe")
  EXPERT_NAMES     our projection name -> the checkpoint's ({"gate_proj": "w1", ...} for Mixtral)
  sanitize(name)   a checkpoint tensor's packed name, or None for tensors that are not weights
  quant_predicate(name, bits)  the bits a resident matrix keeps (None: float)
  build(args, loader, experts) the model (moestream.layers.transformer.MoETransformer)
Optional: EXPERT_ACTIVATION and expert_activation_params(config) (the experts' gate activation and its
settings), EXPERT_FUSED (the fused stacks' layout, convert.layout.FusedLayout), EXPERT_EXPORT, and
build_mtp(args, loader, experts, model, count) with ModelArgs' mtp_* methods for the
multi-token-prediction layers (moestream.models.mtp says where they plug in).

A new family is its file, its tests and a SUPPORTED_FAMILIES entry."""
from __future__ import annotations

import importlib

from moestream import models
from moestream.errors import UnsupportedModelError


def supported() -> str:
    return ", ".join(models.SUPPORTED_FAMILIES)


def family_module(model_type: str):
    # SUPPORTED_FAMILIES is read at each call: the one list of families (tests extend it)
    if not isinstance(model_type, str) or model_type not in models.SUPPORTED_FAMILIES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported (supported: {supported()})")
    return importlib.import_module(f"moestream.models.{model_type}")


def weight_shapes(model_type: str, config: dict, present=(), *, mtp_layers: int = 0) -> dict[str, tuple[int, ...]]:
    """Every resident tensor the family's model takes (name -> shape), as its build takes them;
    `present` names the tensors a checkpoint has, for those a build takes only when present;
    with `mtp_layers`, those of that many multi-token-prediction layers too."""
    from moestream.models.base import ShapeRecorder

    module = family_module(model_type)
    recorder = ShapeRecorder(present)
    args = module.ModelArgs.from_dict(config)
    model = module.build(args, recorder, None)
    if mtp_layers:
        build_mtp(module, model_type)(args, recorder, None, model, mtp_layers)
    return recorder.shapes


def matrix_names(model_type: str, config: dict, present=()) -> set[str]:
    """The resident matrices the family's build takes as matrices (`take_matrix`: kept packed where
    the kernels take them)."""
    from moestream.models.base import ShapeRecorder

    module = family_module(model_type)
    recorder = ShapeRecorder(present)
    module.build(module.ModelArgs.from_dict(config), recorder, None)
    return recorder.matrices


def build_mtp(module, model_type: str):
    """The family's build_mtp (an error for a family without multi-token-prediction layers)."""
    build = getattr(module, "build_mtp", None)
    if build is None:
        raise UnsupportedModelError(f"{model_type} models have no multi-token-prediction layers here")
    return build


def build_model(packed, make_experts, *, device, dtype):
    """The family's ModelArgs from the packed config, then the model with weights on `device`;
    make_experts(args) gives the RoutedExperts the MoE blocks share. The packed model's
    multi-token-prediction layers (manifest `mtp_layers`) are built too, as `model.mtp`."""
    from moestream.models.base import WeightLoader

    module = family_module(packed.family)
    args = module.ModelArgs.from_dict(packed.config)
    experts = make_experts(args)
    loader = WeightLoader(packed, device, dtype)
    model = module.build(args, loader, experts)
    count = packed.manifest.mtp_layers
    model.mtp = build_mtp(module, packed.family)(args, loader, experts, model, count) if count else []
    loader.finish()
    return args, experts, model
