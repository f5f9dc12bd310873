"""The decoder layer and model of Qwen3-Next / Qwen3.5: pre-norm layers whose token mixer is either
gated full attention or Gated DeltaNet (linear attention), every RMSNorm zero-centered (scale
1 + w, applied in float32). The engine's decoder sees the usual `attention_rows` and `ffn`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from moestream.kv.pool import LayerCache
from moestream.layers.attention import offset_rms_norm
from moestream.layers.transformer import MoETransformer


@dataclass
class HybridLayer:
    mixer: object  # Attention (gated) or GatedDeltaNet: forward(x, positions, sequences, kv)
    ffn: Callable[..., torch.Tensor]  # MoEBlock or a dense FFN, called as ffn(x, residual=h)
    input_norm: torch.Tensor  # float32, 1 + w
    post_norm: torch.Tensor  # float32, 1 + w
    eps: float
    writes_split: ClassVar[bool] = False  # (attention_rows takes no `split`: its experts copy their input)

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor,
                 kv: LayerCache) -> torch.Tensor:
        h, hn = self.attention_rows(x, positions, sequences, kv)
        return self.ffn(hn, residual=h)

    def attention_rows(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                       linear=None) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.mixer.forward(offset_rms_norm(x, self.input_norm, self.eps), positions, sequences, kv,
                                   linear=linear)
        return h, offset_rms_norm(h, self.post_norm, self.eps)

    def rows_input_norm(self) -> None:
        """No norm a caller computes for it (zero-centered weights)."""
        return None


class HybridTransformer(MoETransformer):
    """MoETransformer with the zero-centered final norm."""

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(offset_rms_norm(x, self.final_norm, self.eps), self.lm_head).to(torch.float32)
