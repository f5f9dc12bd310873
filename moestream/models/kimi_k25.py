"""Kimi K2.5 (model_type "kimi_k25"): a DeepSeek-V3 language model beside a vision tower and its
projector; the language model only. Its settings are config.json's `text_config`; its weights are
`language_model.model.*` and `language_model.lm_head.weight` as published (`model.language_model.*`
and `lm_head.weight` as transformers names them in memory), `model.*` in the packed model as
deepseek_v3 names them; the tower and projector are left out. Everything else is deepseek_v3."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.models import base
from moestream.models import deepseek_v3
from moestream.models.deepseek_v3 import EXPERT_MODULE, EXPERT_NAMES, build, build_mtp, quant_predicate  # noqa: F401

# the language model's prefixes (published, then transformers' own) -> deepseek_v3's "model."
LANGUAGE_MODEL = ("language_model.model.", "model.language_model.")
LM_HEAD = ("language_model.lm_head.weight", "lm_head.weight")
# transformers renames every "blocks" to "layers" on load and writes it back on save, so a checkpoint
# it saved names the language model's layers "blocks"
SAVED_LAYERS = "blocks."


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    @classmethod
    def from_dict(cls, config: dict):
        return super().from_dict(base.text_model_config(config, "kimi_k25", tie_default=True))


def sanitize(name: str) -> str | None:
    """The language model's tensors as deepseek_v3 names them; the vision tower and projector are not kept."""
    if name in LM_HEAD:
        return "lm_head.weight"
    for prefix in LANGUAGE_MODEL:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if rest.startswith(SAVED_LAYERS):
                rest = "layers." + rest[len(SAVED_LAYERS):]
            return deepseek_v3.sanitize("model." + rest)
    return None


def checkpoint_name(name: str) -> str:
    """The inverse of sanitize for the tensors it keeps, in the published spelling (export_hf writes
    checkpoint names; transformers reads them)."""
    if name == "lm_head.weight":
        return LM_HEAD[0]
    return LANGUAGE_MODEL[0] + name[len("model."):] if name.startswith("model.") else name
