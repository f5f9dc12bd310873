"""Qwen3.5 MoE's language model saved alone (model_type "qwen3_5_moe_text", as transformers'
Qwen3_5MoeForCausalLM writes it): qwen3_5_moe without the vision tower. Its settings are at the top
level of config.json (a `text_config` is read where one is present); its weights are `model.*`, or
`model.language_model.*` where it was saved from the multimodal checkpoint, both `model.*` in the
packed model. Everything else is qwen3_5_moe."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.models import base
from moestream.models import qwen3_5_moe
from moestream.models.qwen3_5_moe import (EXPERT_MODULE, EXPERT_NAMES, build, build_mtp, quant_predicate,  # noqa: F401
                                          sanitize)


@dataclass
class ModelArgs(qwen3_5_moe.ModelArgs):
    @staticmethod
    def language_model_config(config: dict) -> dict:
        return base.language_model_config(config, "qwen3_5_moe_text")
