"""The sparse MoE block: router, top-k, routed experts through an ExpertProvider, optional shared expert.

The block never owns expert weights: it asks the provider for the records of the experts the router
chose, so a cache that misses and reads from disk plugs in without changing the math."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Protocol, Sequence

import torch
import torch.nn.functional as F

from moestream.kernels import dispatch as kernel_dispatch
from moestream.kernels.reference import expert_ffn
from moestream.layers.mlp import swiglu
from moestream.quant.affine import QuantSpec


class ExpertProvider(Protocol):
    """Where routed experts come from. `fetch` may block on reads; the records it returns stay valid
    (pinned) until `release(layer)`."""

    def quant(self, layer: int) -> dict[str, QuantSpec]: ...

    def fetch(self, layer: int, experts: Sequence[int]) -> Mapping[int, dict[str, torch.Tensor]]: ...

    def release(self, layer: int) -> None: ...

    def batch_limit(self, layer: int) -> int:
        """The most experts of `layer` that can be held at once; more are fetched in batches."""
        ...


@dataclass
class SharedExpert:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_weight: torch.Tensor | None = None  # [1, H]: sigmoid gate on the shared expert's output (Qwen2-MoE)


class MoEBlock:
    def __init__(self, layer: int, router: torch.Tensor, provider: ExpertProvider, *, top_k: int,
                 normalize_topk: bool, float32_routing_weights: bool = False, shared: SharedExpert | None = None):
        self.layer, self.router, self.provider = layer, router, provider
        self.top_k, self.normalize_topk = top_k, normalize_topk
        self.float32_routing_weights = float32_routing_weights  # Mixtral keeps them in float32
        self.shared = shared
        self.on_route: Callable[[int, torch.Tensor], None] | None = None  # tracing hook
        # called with the experts' input once this layer's experts are pinned (early reads for later
        # layers start there, so they cannot evict what this layer is about to use)
        self.after_fetch: Callable[[int, torch.Tensor], None] | None = None

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # x [T, H] -> weights [T, A], ids [T, A]
        logits = F.linear(x, self.router)
        out_dtype = torch.float32 if self.float32_routing_weights else x.dtype
        fused = kernel_dispatch.route(logits, self.top_k, normalize=self.normalize_topk, out_dtype=out_dtype)
        if fused is not None:
            return fused
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_topk:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(out_dtype), ids

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for x [T, H]; residual + output when `residual` is given."""
        weights, ids = self.route(x)
        if self.on_route is not None:
            self.on_route(self.layer, ids)
        layout = kernel_dispatch.triton_layout(x, self.provider, self.layer)
        if layout is not None and self.shared is None:  # the last kernel adds the residual
            return kernel_dispatch.routed_experts(x, ids, weights, self.num_experts, self.provider, self.layer,
                                                  layout, residual=residual, after_fetch=self.after_fetch)
        if layout is not None:  # CUDA: grouped kernels read the records straight from the slot pool
            out = kernel_dispatch.routed_experts(x, ids, weights, self.num_experts, self.provider, self.layer, layout,
                                                 after_fetch=self.after_fetch)
        else:
            out = self._reference_experts(x, weights, ids, torch.unique(ids).tolist())
        return self.add_shared(x, out, residual)

    def add_shared(self, x: torch.Tensor, routed: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
        """routed + the shared expert's output on x (if any), + residual (if given)."""
        out = routed
        if self.shared is not None:
            s = self.shared
            y = swiglu(x, s.gate, s.up, s.down)
            if s.gate_weight is not None:
                y = torch.sigmoid(F.linear(x, s.gate_weight)) * y
            out = out + y
        return out if residual is None else residual + out

    def _reference_experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                           experts: list[int]) -> torch.Tensor:
        """The torch reference: each expert's SwiGLU in turn, accumulated in ascending expert order."""
        quant = self.provider.quant(self.layer)
        out = torch.zeros_like(x)
        limit = max(1, self.provider.batch_limit(self.layer))
        for i in range(0, len(experts), limit):  # experts in ascending order, whatever the batching
            batch = experts[i:i + limit]
            records = self.provider.fetch(self.layer, batch)
            if i == 0 and self.after_fetch is not None:
                self.after_fetch(self.layer, x)
            try:
                for e in batch:
                    tok, slot = torch.where(ids == e)
                    y = expert_ffn(x[tok], records[e], quant) * weights[tok, slot, None]
                    out.index_add_(0, tok, y.to(out.dtype))
            finally:
                self.provider.release(self.layer)
        return out
