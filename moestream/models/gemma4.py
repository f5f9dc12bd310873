"""Gemma 4 checkpoints with vision/audio towers (model_type "gemma4"): the language model only.
Its settings are config.json's `text_config`; its weights are `model.language_model.*` (named
`model.*` in the packed model, as gemma4_text names them); the towers and their embedders are
left out. Everything else is gemma4_text."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.models import base
from moestream.models import gemma4_text
from moestream.models.gemma4_text import (EXPERT_ACTIVATION, EXPERT_EXPORT, EXPERT_MODULE, EXPERT_NAMES,  # noqa: F401
                                          build, quant_predicate)

LANGUAGE_MODEL = "model.language_model."


@dataclass
class ModelArgs(gemma4_text.ModelArgs):
    @classmethod
    def from_dict(cls, config: dict):
        return super().from_dict(base.text_model_config(config, "gemma4"))


def sanitize(name: str) -> str | None:
    """model.language_model.X -> model.X; the vision/audio towers and embedders are not kept."""
    if name.startswith(LANGUAGE_MODEL):
        return gemma4_text.sanitize("model." + name[len(LANGUAGE_MODEL):])
    return name if name == "lm_head.weight" else None


def checkpoint_name(name: str) -> str:
    """The inverse of sanitize for the tensors it keeps (export_hf writes checkpoint names)."""
    return LANGUAGE_MODEL + name[len("model."):] if name.startswith("model.") else name
