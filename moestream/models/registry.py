"""Find a family's module by config.json's model_type (one file per family, loaded on demand)."""
from __future__ import annotations

import importlib

from moestream.errors import UnsupportedModelError
from moestream.models import SUPPORTED_FAMILIES


def family_module(model_type: str):
    if model_type not in SUPPORTED_FAMILIES:
        raise UnsupportedModelError(f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_FAMILIES)})")
    return importlib.import_module(f"moestream.models.{model_type}")


def build_model(packed, provider, *, device, dtype):
    """The family's ModelArgs from the packed config, then the stack with weights on `device`."""
    from moestream.models.base import WeightLoader

    module = family_module(packed.family)
    args = module.ModelArgs.from_dict(packed.config)
    return args, module.build(args, WeightLoader(packed, device, dtype), provider)
