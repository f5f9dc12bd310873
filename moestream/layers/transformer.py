"""The decoder stack shared by every family: embed -> layers (attention + FFN/MoE) -> norm -> head."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moestream.engine.kv_cache import KVCache
from moestream.layers.attention import Attention
from moestream.layers.norm import rms_norm
from moestream.layers.rope import Rope


@dataclass
class DecoderLayer:
    attn: Attention
    ffn: Callable[[torch.Tensor], torch.Tensor]  # MoEBlock or a dense SwiGLU
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float

    def __call__(self, x, cos, sin, cache: KVCache, layer: int, start: int) -> torch.Tensor:
        h, hn = self.attention_half(x, cos, sin, cache, layer, start)
        return self.ffn(hn, residual=h)

    def attention_half(self, x, cos, sin, cache: KVCache, layer: int, start: int):
        """Everything before the FFN: (the residual stream after attention, its normed copy)."""
        h = x + self.attn(rms_norm(x, self.input_norm, self.eps), cos, sin, cache, layer, start)
        return h, rms_norm(h, self.post_norm, self.eps)

    def decode_attention_half(self, x, pos: torch.Tensor, inv_freq: torch.Tensor, cache: KVCache, layer: int):
        """attention_half for one token at the device position `pos`, in fused CUDA kernels."""
        from moestream.kernels import triton_decode as td

        a = self.attn.decode(td.rms_norm(x, self.input_norm, self.eps), pos, inv_freq, cache, layer)
        return td.add_rms_norm(x, a, self.post_norm, self.eps)


class MoETransformer:
    def __init__(self, *, embed: torch.Tensor, layers: list[DecoderLayer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, rope: Rope, eps: float, num_kv_heads: int, head_dim: int):
        self.embed, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.rope, self.eps = rope, eps
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    @property
    def device(self) -> torch.device:
        return self.embed.device

    def forward(self, ids: torch.Tensor, start: int, cache: KVCache, *, all_logits: bool = False) -> torch.Tensor:
        """ids [T] at positions start.. -> logits [T, V] (or [1, V] for the last token) in float32."""
        x = F.embedding(ids, self.embed)  # [T, H]
        positions = torch.arange(start, start + ids.shape[0], device=ids.device)
        cos, sin = self.rope.cos_sin(positions, x.dtype)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, cache, i, start)
        cache.length = start + ids.shape[0]
        if not all_logits:
            x = x[-1:]
        return F.linear(rms_norm(x, self.final_norm, self.eps), self.lm_head).to(torch.float32)
