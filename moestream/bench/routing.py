"""Routing for honest streaming benchmarks: after each router, replace the chosen experts.

Random weights do not route like a trained model (on the Qwen3-30B-A3B shape they collapse onto a
few experts, so any cache hits), so streamed speed is measured at a known hit rate instead:

  model         the model's own router (no replacement)
  uniform       each token's A experts drawn uniformly without replacement
  zipf:S[:L]    drawn without replacement with P(expert of rank r) ∝ r^-S over a fixed per-layer
                ranking (Gumbel top-k), plus temporal locality: the previous token's experts get
                L added to their log-weight (L = 0: none; default 1); in a prefill chunk of more
                than 16 tokens every token sees the previous step's choice
  trace:FILE    a recorded routing trace (`--trace-routing` files) replayed position by position;
                a trace with fewer experts or a smaller top-k is tiled: model layer l replays trace
                layer l mod L_t, and top-k copy c adds E_t · ((c + l div L_t) mod (E / E_t)) to the ids

Only `moestream bench` builds an engine with one (`RoutedExperts.reroute`); generate and serve never do. Every
replacement is device ops only (no host sync), so CUDA graphs capture it. The routing weights
stay the router's (the same values, now on other experts)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from moestream.errors import MoestreamError


@dataclass
class RoutingSpec:
    kind: str  # model, uniform, zipf, trace
    skew: float = 0.0
    locality: float = 0.0
    trace: str | None = None

    def to_json(self) -> dict:
        out = {"routing": self.kind}
        if self.kind == "zipf":
            out.update(zipf_s=self.skew, zipf_locality=self.locality)
        if self.kind == "trace":
            out["trace"] = self.trace
        return out


def parse_routing(text: str) -> RoutingSpec:
    kind, _, rest = text.partition(":")
    if kind in ("model", "uniform") and not rest:
        return RoutingSpec(kind)
    if kind == "zipf":
        parts = rest.split(":") if rest else []
        try:
            skew = float(parts[0])
            locality = float(parts[1]) if len(parts) > 1 else 1.0
        except (ValueError, IndexError):
            raise MoestreamError(f"--routing {text!r}: expected zipf:S or zipf:S:L with numbers (e.g. zipf:1.1)") from None
        if len(parts) > 2 or not (math.isfinite(skew) and skew >= 0 and math.isfinite(locality) and locality >= 0):
            raise MoestreamError(f"--routing {text!r}: S and L must be finite and >= 0")
        return RoutingSpec("zipf", skew=skew, locality=locality)
    if kind == "trace" and rest:
        return RoutingSpec("trace", trace=rest)
    raise MoestreamError(f"--routing {text!r}: choose model, uniform, zipf:S[:L] or trace:FILE")


class Rerouter:
    """The replacement for every MoE layer of one engine (see the module doc)."""

    def __init__(self, spec: RoutingSpec, moe_layers: list[int], num_experts: int, top_k: int, *,
                 device: torch.device, seed: int = 0):
        self.spec, self.E, self.A, self.device = spec, num_experts, top_k, device
        # the default generator: CUDA graphs capture its draws (a generator of our own would need registering)
        torch.manual_seed(seed)
        g = torch.Generator().manual_seed(seed)
        self.log_weights, self.previous, self.replay, self.cursor = {}, {}, {}, {}
        if spec.kind == "zipf":
            ranks = torch.arange(1, num_experts + 1, dtype=torch.float32)
            base = -spec.skew * torch.log(ranks)
            for layer in moe_layers:  # a fixed ranking per layer: the hot experts differ between layers
                order = torch.randperm(num_experts, generator=g)
                lw = torch.empty(num_experts)
                lw[order] = base
                self.log_weights[layer] = lw.to(device)
                self.previous[layer] = torch.zeros(num_experts, device=device)
        elif spec.kind == "trace":
            self._load_trace(spec.trace, moe_layers)

    def _load_trace(self, path: str, moe_layers: list[int]) -> None:
        from moestream.experts.trace import RoutingTrace

        try:
            trace = RoutingTrace.load(path)
        except (OSError, ValueError, KeyError) as exc:
            raise MoestreamError(f"--routing trace:{path}: not a routing trace ({exc})") from None
        e_t, a_t = int(trace.meta.get("num_experts", 0)), int(trace.experts.shape[1])
        copies = self.A // a_t if a_t else 0
        if not e_t or self.A % a_t or self.E % e_t or self.E // e_t < copies:
            raise MoestreamError(f"--routing trace:{path}: a trace of {e_t} experts, top-{a_t} cannot be tiled onto "
                                 f"{self.E} experts, top-{self.A}")
        layers_t = sorted(set(trace.layer.tolist()))
        groups = self.E // e_t
        for i, layer in enumerate(moe_layers):
            rows = trace.experts[trace.layer == layers_t[i % len(layers_t)]]  # [P, a_t], position order
            parts = [torch.from_numpy(rows.astype("int64")) + e_t * ((c + i // len(layers_t)) % groups)
                     for c in range(copies)]
            self.replay[layer] = torch.cat(parts, dim=1).to(self.device)  # [P, A]
            self.cursor[layer] = torch.zeros(1, dtype=torch.long, device=self.device)

    def __call__(self, layer: int, weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kind = self.spec.kind
        if kind == "model":
            return weights, ids
        T = ids.shape[0]
        if kind == "uniform":
            noise = torch.rand((T, self.E), device=ids.device)
            return weights, noise.topk(self.A, dim=-1).indices.to(ids.dtype)
        if kind == "zipf":
            u = torch.rand((T, self.E), device=ids.device).clamp_(1e-20, 1.0)
            gumbel = -torch.log(-torch.log(u))
            prev = self.previous[layer]
            if T > 16:  # a prefill chunk: every token sees the previous step's choice (one op, not T)
                chosen = (self.log_weights[layer] + self.spec.locality * prev + gumbel).topk(self.A, dim=-1).indices
                prev.zero_().index_fill_(0, chosen[-1], 1.0)
                return weights, chosen.to(ids.dtype)
            out = []
            for t in range(T):  # token by token: each sees the previous token's choice
                chosen = (self.log_weights[layer] + self.spec.locality * prev + gumbel[t]).topk(self.A).indices
                prev = torch.zeros_like(prev).index_fill_(0, chosen, 1.0)
                out.append(chosen)
            self.previous[layer].copy_(prev)
            return weights, torch.stack(out).to(ids.dtype)
        table, cursor = self.replay[layer], self.cursor[layer]
        rows = (cursor + torch.arange(T, device=ids.device)) % table.shape[0]
        cursor.add_(T)
        return weights, table.index_select(0, rows).to(ids.dtype)


def rerouter(spec: RoutingSpec, *, seed: int = 0):
    """What an Engine takes to replace the routing of every MoE layer (`reroute`: a benchmark only):
    (args, device) -> Rerouter; None for the model's own routing."""
    if spec.kind == "model":
        return None
    return lambda args, device: Rerouter(spec, args.moe_layers(), args.num_experts, args.num_experts_per_tok,
                                         device=device, seed=seed)
