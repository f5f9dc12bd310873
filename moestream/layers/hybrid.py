"""The decoder layer and model of Qwen3-Next / Qwen3.5: pre-norm layers whose token mixer is either
gated full attention or Gated DeltaNet (linear attention), every RMSNorm zero-centered (scale
1 + w, applied in float32). The engine's decoder sees the usual `attention_step` and `ffn`."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moestream.layers.gated_attention import offset_rms_norm
from moestream.layers.kv_cache import KVCache
from moestream.layers.transformer import MoETransformer


@dataclass
class HybridLayer:
    mixer: object  # GatedAttention or GatedDeltaNet: __call__ for prefill, step for one token
    ffn: Callable[..., torch.Tensor]  # MoEBlock or a dense FFN, called as ffn(x, residual=h)
    input_norm: torch.Tensor  # float32, 1 + w
    post_norm: torch.Tensor  # float32, 1 + w
    eps: float

    def __call__(self, x, cos, sin, cache: KVCache, layer: int, start: int) -> torch.Tensor:
        h = x + self.mixer(offset_rms_norm(x, self.input_norm, self.eps), cos, sin, cache, layer, start)
        return self.ffn(offset_rms_norm(h, self.post_norm, self.eps), residual=h)

    def attention_step(self, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        h = x + self.mixer.step(offset_rms_norm(x, self.input_norm, self.eps), pos, cache, layer)
        return h, offset_rms_norm(h, self.post_norm, self.eps)


class HybridTransformer(MoETransformer):
    """MoETransformer with the zero-centered final norm."""

    def head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(offset_rms_norm(x, self.final_norm, self.eps), self.lm_head).to(torch.float32)

    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        x = self.embed(ids)  # [T, H]
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start)
        if self.on_hidden is not None:
            self.on_hidden(start, x)
        return self.head(x if all_logits else x[-1:])
