"""A MoETransformer whose embedding is scaled (Gemma: by sqrt(hidden), rounded to the weights'
dtype as the reference does), whose final norm scales in float32, and whose logits are
soft-capped: cap * tanh(logits / cap). Layers bring their own rotary tables."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from moestream.layers.norm_f32 import rms_norm_f32
from moestream.layers.transformer import MoETransformer


class SoftcapTransformer(MoETransformer):
    def __init__(self, *, embed_scale: float, softcap: float | None, **kwargs):
        super().__init__(rope=None, **kwargs)
        self.embed_scale, self.softcap = embed_scale, softcap

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_weight
        scale = getattr(self, "_embed_scale", None)
        if scale is None or scale.device != w.device:  # made once, outside any CUDA graph capture
            scale = self._embed_scale = torch.tensor(self.embed_scale, dtype=w.dtype, device=w.device)
        return F.embedding(ids, w) * scale

    def head(self, x: torch.Tensor) -> torch.Tensor:
        logits = F.linear(rms_norm_f32(x, self.final_norm, self.eps), self.lm_head).to(torch.float32)
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap
