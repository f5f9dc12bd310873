"""The pre-norm decoder layer and the model around a stack of them: embed -> layers -> norm -> head.

What the engine and the CUDA decoder ask of a model is here and nowhere else: `embed`, each layer's
`attention_rows` and `ffn`, `head`, and `forward` for prefill chunks. A family whose layer differs
gives its layer the same two methods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, ClassVar

import torch
import torch.nn.functional as F

from moestream.kernels.reference import rows_exact, rows_linear
from moestream.kv.pool import KVPool, LayerCache
from moestream.layers.attention import Attention
from moestream.layers.norm import rms_norm
from moestream.layers.rope import Rope


def _fused_norms():
    try:
        from moestream.kernels import triton_decode
    except ImportError:
        return None
    return triton_decode


@dataclass
class DecoderLayer:
    attn: Attention  # or any attention kind with the same forward (moestream.layers.mla)
    ffn: Callable[..., torch.Tensor]  # MoEBlock or a dense FFN, called as ffn(x, residual=h)
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    eps: float
    # attention_rows writes the experts' gemv input (`split`) with its post-attention norm
    writes_split: ClassVar[bool] = True

    def __call__(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor,
                 kv: LayerCache) -> torch.Tensor:
        """The whole layer for x [T, H] (a prefill chunk)."""
        h, hn = self.attention_rows(x, positions, sequences, kv)
        return self.ffn(hn, residual=h)

    def attention_rows(self, x: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: LayerCache, *,
                       linear=None, normed: torch.Tensor | None = None,
                       split: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the FFN for the rows x [R, H], the first T = len(positions) of them tokens:
        (h, hn) [R, H], the residual stream after attention and its normed copy. linear: the products'
        kernel. normed: x's input norm (`rows_input_norm`) where the caller computed it already;
        split: hn's float32 copy for the gemv expert kernels (triton_decode.add_rms_norm)."""
        # the fused norm kernels on CUDA, and wherever a caller hands their results in
        td = _fused_norms() if x.is_cuda or normed is not None or split is not None else None
        if td is None:
            h = x + self.attn.forward(rms_norm(x, self.input_norm, self.eps), positions, sequences, kv, linear=linear)
            return h, rms_norm(h, self.post_norm, self.eps)
        if normed is None:
            normed = td.rms_norm(x, self.input_norm, self.eps)
        a = self.attn.forward(normed, positions, sequences, kv, linear=linear)
        return td.add_rms_norm(x, a, self.post_norm, self.eps, split=split)

    def rows_input_norm(self) -> tuple[torch.Tensor, float] | None:
        """(weight, eps) of the RMSNorm attention_rows applies to x first, which a caller may compute
        itself and pass as `normed` (triton_decode.rms_norm's arithmetic)."""
        return self.input_norm, self.eps


class MoETransformer:
    def __init__(self, *, embed: torch.Tensor, layers: list[DecoderLayer], final_norm: torch.Tensor,
                 lm_head: torch.Tensor, rope: Rope, eps: float):
        self.embed_weight, self.layers, self.final_norm, self.lm_head = embed, layers, final_norm, lm_head
        self.rope, self.eps = rope, eps
        self.mtp: list = []  # multi-token-prediction layers (moestream.layers.mtp), where the packed model has them
        # prefill's hook on the final residual stream: on_hidden(start, x [T, H]) (the MTP drafter's input)
        self.on_hidden: Callable[[int, torch.Tensor], None] | None = None

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    @property
    def hidden_size(self) -> int:
        return self.embed_weight.shape[1]

    @property
    def vocab_size(self) -> int:
        return self.lm_head.shape[0]

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [T] -> x [T, H]."""
        return F.embedding(ids, self.embed_weight)

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> logits [T, V] in float32."""
        td = _fused_norms() if x.is_cuda and x.shape[0] == 1 else None
        normed = td.rms_norm(x, self.final_norm, self.eps) if td is not None else rms_norm(x, self.final_norm, self.eps)
        return F.linear(normed, self.lm_head).to(torch.float32)

    def tile_head(self, x: torch.Tensor, linear=F.linear) -> torch.Tensor:
        """head over a decode step's fixed row tile x [R, H], its product computed by `linear` (the
        row tile's kernel: moestream.layers.tile_products); a family's own head keeps its own products."""
        if type(self).head is not MoETransformer.head or linear is F.linear:
            return self.head(x)
        td = _fused_norms() if x.is_cuda else None  # one kernel, not torch's eight
        normed = td.rms_norm(x, self.final_norm, self.eps) if td is not None else rms_norm(x, self.final_norm, self.eps)
        return linear(normed, self.lm_head).to(torch.float32)

    def rows_head(self, x: torch.Tensor) -> torch.Tensor:
        """head for rows x [T, H] on the CPU, each row with the bits `head` gives it alone: one
        batched call of one-row products where `rows_exact` allows (a family's own head: row by row)."""
        if type(self).head is MoETransformer.head and not x.is_cuda and \
                rows_exact(x.dtype, self.lm_head.shape[1], self.lm_head.shape[0]):
            normed = rms_norm(x, self.final_norm, self.eps)
            return rows_linear(normed, self.lm_head).view(x.shape[0], -1).to(torch.float32)
        return torch.cat([self.head(x[t:t + 1]) for t in range(x.shape[0])])

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, sequences: torch.Tensor, kv: KVPool, *,
                all_logits: bool = False, last_row: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill chunk: ids [T] at positions [T] of sequences [T] -> logits [T, V] (or [1, V] for the
        last token) in float32. The caller reserved the rows' blocks and records the tokens. last_row:
        a device index [1] of the row whose logits to return instead of the last (rows past it are padding)."""
        x = self.embed(ids)  # [T, H]
        for i, layer in enumerate(self.layers):
            x = layer(x, positions, sequences, kv.layer(i))
        if self.on_hidden is not None:
            self.on_hidden(int(positions[0]), x)
        if not all_logits:
            x = x[-1:] if last_row is None else x.index_select(0, last_row)
        return self.head(x)
