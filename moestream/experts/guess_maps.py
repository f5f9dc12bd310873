"""Fitted lookahead maps: a better guess of a later MoE layer's router logits from this layer's
expert input.

The lookahead guesses layer l+d's experts with its router R on layer l's expert input x (the residual
stream changes little between layers). A map corrects it: guess = R x + u (v x) + c, fitted by ridge
regression toward the plain router on pairs (x_l, R x_{l+d}), then cut to rank r. On the device it is
three fixed-shape matmuls (inside the decoder's graphs). The real router still chooses: a map never
changes an output.

Legend: N rows (tokens), H hidden, E experts of the target layer, r the correction's rank, k top-k."""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

FORMAT = "moestream-lookahead-maps/1"
FILE_NAME = "lookahead.safetensors"  # next to a packed model's moestream.json: the engine uses it there
ALPHAS = (1e-3, 1e-2, 1e-1, 1.0, 10.0)  # ridge strengths tried, relative to the mean feature variance


def manifest_digest(model_dir: str | Path) -> str:
    """sha256 of a packed model's moestream.json: maps are fitted for exactly one model."""
    return hashlib.sha256((Path(model_dir) / "moestream.json").read_bytes()).hexdigest()


def overlap(guess: torch.Tensor, actual: torch.Tensor) -> torch.Tensor:
    """Per row, the share of `actual`'s experts that `guess` names: guess [N, k'], actual [N, k] -> [N]."""
    hit = (guess.unsqueeze(2) == actual.unsqueeze(1)).any(dim=1)  # [N, k]: actual expert named?
    return hit.float().mean(dim=1)


def top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    return torch.topk(logits, k, dim=-1).indices


@dataclass
class GuessMap:
    """The correction of one (target layer, depth): guess logits = router(x) + u (v x) + bias."""

    u: torch.Tensor  # [E, r]
    v: torch.Tensor  # [r, H]
    bias: torch.Tensor  # [E]
    alpha: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.u, self.v, self.bias))

    def correction(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, E] float32."""
        return F.linear(F.linear(x.float(), self.v), self.u, self.bias)


def fit_map(x: torch.Tensor, target: torch.Tensor, router: torch.Tensor, router_bias: torch.Tensor | None = None, *,
            alpha: float = 0.1, rank: int = 0) -> GuessMap:
    """The ridge fit of target [N, E] (layer l+d's router logits) from x [N, H] (layer l's expert
    input), pulled toward the plain router [E, H]: min |X W^T + c - Y|^2 + lam |W - R|^2, lam =
    alpha * the mean variance of x's features. rank > 0 keeps that many singular directions of W - R."""
    x, y = x.double(), target.double()
    r = router.double()
    base = F.linear(x, r, None if router_bias is None else router_bias.double())
    y = y - base  # fit the residual of the plain guess: W = R + D, regularize D toward 0
    xm, ym = x.mean(0), y.mean(0)
    xc, yc = x - xm, y - ym
    gram = xc.T @ xc  # [H, H]
    lam = alpha * float(torch.diagonal(gram).mean().clamp_min(1e-12))
    d = torch.linalg.solve(gram + lam * torch.eye(gram.shape[0], dtype=gram.dtype), xc.T @ yc).T  # [E, H]
    u_, s, vh = torch.linalg.svd(d, full_matrices=False)
    keep = min(rank, s.numel()) if rank > 0 else s.numel()
    u, v = u_[:, :keep] * s[:keep], vh[:keep]
    bias = ym - (u @ (v @ xm))  # the mean residual the kept directions do not explain
    return GuessMap(u.float().contiguous(), v.float().contiguous(), bias.float(), alpha)


def choose_and_fit(x: torch.Tensor, target: torch.Tensor, actual: torch.Tensor, router: torch.Tensor,
                   router_bias: torch.Tensor | None = None, *, rank: int = 0, alphas=ALPHAS,
                   holdout: float = 0.2) -> GuessMap:
    """fit_map with the ridge strength that guesses `actual` [N, k] best on the last `holdout` of
    the rows (fitted on the rest), refitted on all rows."""
    n = x.shape[0]
    cut = max(1, int(n * (1 - holdout)))
    k = actual.shape[1]
    base = F.linear(x[cut:].float(), router.float(), None if router_bias is None else router_bias.float())
    best, best_acc = alphas[0], -1.0
    for a in alphas:
        m = fit_map(x[:cut], target[:cut], router, router_bias, alpha=a, rank=rank)
        acc = float(overlap(top_k(base + m.correction(x[cut:]), k), actual[cut:]).mean())
        if acc > best_acc + 1e-9:
            best, best_acc = a, acc
    return fit_map(x, target, router, router_bias, alpha=best, rank=rank)


def maps_path(model_dir: str | Path, choice: str) -> Path | None:
    """The maps file an engine uses: choice "auto" (MODEL/lookahead.safetensors where it exists),
    "none", or a path."""
    if choice == "none":
        return None
    if choice == "auto":
        path = Path(model_dir) / FILE_NAME
        return path if path.is_file() else None
    return Path(choice)


class GuessMaps:
    """The maps of a model, keyed by (target MoE layer, depth): depth 1 guesses a layer from the
    MoE layer before it, depth 2 from the one before that."""

    def __init__(self, maps: dict[tuple[int, int], GuessMap], meta: dict | None = None):
        self.maps, self.meta = maps, dict(meta or {})

    def get(self, layer: int, depth: int) -> GuessMap | None:
        return self.maps.get((layer, depth))

    @property
    def nbytes(self) -> int:
        return sum(m.nbytes for m in self.maps.values())

    def logits(self, block, depth: int, x: torch.Tensor) -> torch.Tensor:
        """The guess of `block`'s router logits [T, E] from an earlier layer's expert input x [T, H]."""
        base = block.router_logits(x)
        m = self.maps.get((block.layer, depth))
        return base if m is None else base.float() + m.correction(x)

    def to(self, device) -> "GuessMaps":
        return GuessMaps({k: GuessMap(m.u.to(device), m.v.to(device), m.bias.to(device), m.alpha)
                          for k, m in self.maps.items()}, self.meta)

    def save(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        tensors = {}
        for (layer, depth), m in sorted(self.maps.items()):
            for name in ("u", "v", "bias"):
                tensors[f"layers.{layer}.depth{depth}.{name}"] = getattr(m, name).contiguous().cpu()
        meta = {**self.meta, "format": FORMAT, "alphas": {f"{l}@{d}": m.alpha for (l, d), m in self.maps.items()}}
        save_file(tensors, str(path), metadata={"moestream": json.dumps(meta)})

    @classmethod
    def load(cls, path: str | Path) -> "GuessMaps":
        """Raises ValueError (one line) for a file that is not a map file."""
        from safetensors import SafetensorError, safe_open

        try:
            with safe_open(str(path), "pt") as f:
                meta = json.loads((f.metadata() or {}).get("moestream", "{}"))
                if meta.get("format") != FORMAT:
                    raise ValueError(f"{path}: not a lookahead map file ({FORMAT})")
                parts: dict[tuple[int, int], dict] = {}
                for key in f.keys():
                    _, layer, depth, name = key.split(".")
                    parts.setdefault((int(layer), int(depth.removeprefix("depth"))), {})[name] = f.get_tensor(key)
        except (OSError, json.JSONDecodeError, ValueError, KeyError, SafetensorError) as exc:
            if isinstance(exc, ValueError) and str(exc).startswith(str(path)):
                raise
            raise ValueError(f"{path}: cannot read lookahead maps ({exc})") from None
        alphas = meta.get("alphas", {})
        maps = {k: GuessMap(p["u"].float(), p["v"].float(), p["bias"].float(), alphas.get(f"{k[0]}@{k[1]}", 0.0))
                for k, p in parts.items()}
        return cls(maps, meta)

    def check(self, blocks, hidden_size: int) -> None:
        """Raise ValueError where a map does not fit the model's MoE blocks (layer, E, H)."""
        by_layer = {b.layer: b for b in blocks}
        order = [b.layer for b in blocks]
        for (layer, depth), m in self.maps.items():
            if layer not in by_layer or order.index(layer) < depth:
                raise ValueError(f"lookahead map for layer {layer} depth {depth}: the model has no such MoE layer pair")
            e = by_layer[layer].num_experts
            if m.u.shape[0] != e or m.bias.shape != (e,) or m.v.shape[1] != hidden_size or m.u.shape[1] != m.v.shape[0]:
                raise ValueError(f"lookahead map for layer {layer} depth {depth} has shape u {tuple(m.u.shape)}, "
                                 f"v {tuple(m.v.shape)}; the model wants [{e}, r], [r, {hidden_size}]")
