"""Qwen3.5 MoE checkpoints (model_type "qwen3_5_moe", a vision tower beside the language model):
the language model only. Its settings are config.json's `text_config`; its weights are
`model.language_model.*` (named `model.*` in the packed model, as qwen3_next names them) and its
multi-token-prediction layers `mtp.*` (kept as they are); the tower is left out. The architecture is
qwen3_next's, with the linear attention's projections stored apart (in_proj_qkv, in_proj_z,
in_proj_b, in_proj_a), every layer MoE and the top-k weights always renormalized. Its multimodal
rotary (mrope) gives text positions the plain rotary. Text-only saves are qwen3_5_moe_text."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from moestream.models import base
from moestream.models import qwen3_next
from moestream.models.qwen3_next import EXPERT_MODULE, EXPERT_NAMES, build, build_mtp, quant_predicate  # noqa: F401

LANGUAGE_MODEL = "model.language_model."
# the language model's own names, as a save of the text model alone writes them
TEXT_MODEL = ("model.embed_tokens.", "model.layers.", "model.norm.")


@dataclass
class ModelArgs(qwen3_next.ModelArgs):
    SPLIT_PROJECTIONS: ClassVar[bool] = True

    @classmethod
    def from_dict(cls, config: dict):
        text = cls.language_model_config(config)
        # Qwen3.5 has no dense layers and always renormalizes (its config has no such fields)
        text.update(norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])
        return super().from_dict(text)

    @staticmethod
    def language_model_config(config: dict) -> dict:
        return base.text_model_config(config, "qwen3_5_moe")


def sanitize(name: str) -> str | None:
    """model.language_model.X -> model.X, and the text model's own model.X as it is; lm_head and
    mtp.* as they are; the vision tower is not kept. Both spellings occur under either model_type
    (transformers writes a text-only save of the multimodal model with the nested names)."""
    if name.startswith(LANGUAGE_MODEL):
        return qwen3_next.sanitize("model." + name[len(LANGUAGE_MODEL):])
    if name == "lm_head.weight" or name.startswith((qwen3_next.MTP, *TEXT_MODEL)):
        return qwen3_next.sanitize(name)
    return None


def checkpoint_name(name: str) -> str:
    """The inverse of sanitize for the tensors it keeps (export_hf writes checkpoint names)."""
    return LANGUAGE_MODEL + name[len("model."):] if name.startswith("model.") else name
