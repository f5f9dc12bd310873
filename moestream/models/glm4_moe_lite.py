"""GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's architecture (latent attention, sigmoid
group-limited routing, shared experts) with the dense layers listed in `mlp_layer_types`."""
from __future__ import annotations

from dataclasses import dataclass

from moestream.models import deepseek_v3
from moestream.models.deepseek_v3 import EXPERT_MODULE, EXPERT_NAMES, build, build_mtp, quant_predicate, sanitize  # noqa: F401


@dataclass
class ModelArgs(deepseek_v3.ModelArgs):
    mlp_layer_types: list[str] | None = None  # "dense" / "sparse" per layer; default: the first dense

    def is_moe_layer(self, i: int) -> bool:
        kinds = self.mlp_layer_types or ["dense"] + ["sparse"] * (self.num_hidden_layers - 1)
        return self.num_experts > 0 and kinds[i] == "sparse"
