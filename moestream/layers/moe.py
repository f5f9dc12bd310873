"""The sparse MoE block: router, routed experts (through RoutedExperts), optional shared expert.

The block never owns expert weights: RoutedExperts asks the slot cache for the experts the router
chose, so a cache that misses and reads from disk plugs in without changing the math."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from moestream.layers.experts import RoutedExperts
from moestream.kernels.reference import rowwise
from moestream.layers.mlp import swiglu

Router = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits [T, E] -> weights, ids [T, A]


@dataclass
class SharedExpert:
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor
    gate_weight: torch.Tensor | None = None  # [1, H]: sigmoid gate on the shared expert's output (Qwen2-MoE)

    def __call__(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor:
        y = swiglu(x, self.gate, self.up, self.down, linear=linear)
        if self.gate_weight is not None:
            y = rowwise(torch.sigmoid, linear(x, self.gate_weight)) * y
        return y


class MoEBlock:
    def __init__(self, layer: int, router: torch.Tensor, route_fn: Router, experts: RoutedExperts, *,
                 top_k: int, shared: SharedExpert | None = None, router_bias: torch.Tensor | None = None):
        self.layer, self.router, self.route_fn, self.experts = layer, router, route_fn, experts
        self.top_k, self.shared, self.router_bias = top_k, shared, router_bias

    @property
    def num_experts(self) -> int:
        return self.router.shape[0]

    def router_logits(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor:
        """x [T, H] -> [T, E] in the router's dtype (a family keeping its router in float32 computes
        the logits in float32 from any activation dtype, as its reference does). linear: the
        product's kernel (a decode step's row tile: moestream.layers.tile_products)."""
        return linear(x.to(self.router.dtype), self.router, self.router_bias)

    def route(self, x: torch.Tensor, *, linear=F.linear, fused=None) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> routing weights [T, A], expert ids [T, A]. fused: a kernel that takes the
        router product and a softmax top-k at once, called as fused(x, router, top_k, normalize=,
        out_dtype=) (moestream.kernels.triton_route.route_rows), where `fuses` allows it."""
        spec = getattr(self.route_fn, "softmax_topk", None)
        if fused is not None and self.fuses(x.dtype):
            return self._rerouted(*fused(x, self.router, spec["top_k"], normalize=spec["normalize"],
                                         out_dtype=torch.float32 if spec["float32_weights"] else x.dtype))
        return self._rerouted(*self.route_fn(self.router_logits(x, linear=linear)))

    def fuses(self, dtype: torch.dtype, max_experts: int | None = None) -> bool:
        """Whether route(x, fused=...) takes the fused kernel for x of `dtype`: a softmax top-k router
        (models.base's softmax_router) with no bias, in that dtype (and at most max_experts experts)."""
        return getattr(self.route_fn, "softmax_topk", None) is not None and self.router_bias is None and \
            self.router.dtype == dtype and (max_experts is None or self.num_experts <= max_experts)

    def _rerouted(self, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.experts.reroute is not None:  # benchmarks only: routing at a known hit rate
            weights, ids = self.experts.reroute(self.layer, weights, ids)
        return weights, ids

    def shared_out(self, x: torch.Tensor, *, linear=F.linear) -> torch.Tensor | None:
        return self.shared(x, linear=linear) if self.shared is not None else None

    def combine(self, routed: torch.Tensor, shared: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
        """routed + shared (if any), + residual (if given): the order every path adds them in."""
        out = routed if shared is None else routed + shared
        return out if residual is None else residual + out

    def __call__(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The block's output for x [T, H]; residual + output when `residual` is given."""
        weights, ids = self.route(x)
        if self.shared is None:  # the experts' last kernel adds the residual
            return self.experts(self.layer, x, ids, weights, residual=residual)
        return self.combine(self.experts(self.layer, x, ids, weights), self.shared_out(x), residual)
