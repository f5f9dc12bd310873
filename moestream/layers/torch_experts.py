"""The torch reference plan of a layer's routed experts (TorchPlan): the CPU's experts, and any record
layout the Triton kernels do not take. Each chosen expert's record is decoded and dequantized (or taken
from the kept unpacked copies), its gated FFN run for its pairs, and the weighted results added per
expert in ascending id order, so the sum's order never depends on which experts a batch holds."""
from __future__ import annotations

import functools
from typing import Mapping, Sequence

import torch
import torch.nn.functional as F

from moestream.format.records import decode_record
from moestream.kernels.reference import BIASED_ACTIVATIONS, projection, rows_exact, rows_linear
from moestream.layers.clamped_swiglu import clamped_swiglu
from moestream.layers.gelu_mlp import gelu_glu
from moestream.layers.mlp import swiglu
from moestream.quant.affine import QuantSpec, dequantize_many
# a record's gate activation (QuantSpec.activation) -> its gated FFN (the Triton kernels compute each too)
ACTIVATIONS = {"silu": swiglu, "gelu_tanh": gelu_glu, "clamped_swiglu": clamped_swiglu}
BIASED = BIASED_ACTIVATIONS  # activations whose records hold gate_proj.bias, up_proj.bias, down_proj.bias
PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
# torch's CPU SiLU runs whole vectors of 2 x 16 floats (AVX-512) and a tail in scalar code; rows of a
# multiple of 64 fall on whole vectors alone or side by side. Under SERIAL_ELEMENTS (torch's grain
# size) an elementwise op is never split between threads, so no thread's range starts mid-row
SILU_VECTOR = 64
SERIAL_ELEMENTS = 32768


def activation_of(quant: Mapping[str, QuantSpec]) -> str:
    name = quant["gate_proj"].activation
    if name not in ACTIVATIONS:
        raise ValueError(f"routed experts with activation {name!r} (known: {', '.join(ACTIVATIONS)})")
    spec = quant["gate_proj"]
    if name == "clamped_swiglu" and (spec.alpha is None or spec.limit is None):
        raise ValueError("routed experts with activation 'clamped_swiglu' need its alpha and limit in the quant spec")
    return name


class TorchPlan:
    """The torch reference over the slot pool, with MoEPlan's interface (`run`, `run_table`, `finish`).

    With per_pair every (token, expert) pair is its own one-row product, so a token's result does not
    depend on how many tokens are computed together (CPU BLAS picks other kernels for other row
    counts); on the CPU those rows go through one batched call per expert and projection where
    `rows_exact` allows. Otherwise each expert's tokens go through one matmul (prefill)."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fields, quant, *,
                 per_pair: bool = False, unpacked=None, layer: int = 0):
        self.x, self.ids, self.weights, self.fields, self.quant = x, ids, weights, fields, quant
        self.per_pair = per_pair
        self.ffn = ACTIVATIONS[activation_of(quant)]
        self.biased = quant["gate_proj"].activation in BIASED
        self.out = torch.zeros_like(x)  # [T, H]
        self.unpacked, self.layer = unpacked, layer  # a moestream.experts.unpacked.UnpackedExperts, or None

    def run(self, pool: torch.Tensor, experts: Sequence[int], slots: Sequence[int]) -> None:
        todo = [(e, slot) for e, slot in sorted(zip(experts, slots))
                if slot >= 0]  # slot < 0: computed elsewhere (a CPU share): its rows come through take_rows
        if self.per_pair and todo and self._rows_at_once():
            self._run_rows(pool, todo)
            return
        for e, slot in todo:
            tok, _, rows = self.expert_rows(pool, e, slot)
            self.out.index_add_(0, tok, rows)

    def matrices(self, pool: torch.Tensor, e: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's gate, up and down matrices in x's dtype, from its record in `slot`."""
        def unpack():
            record = decode_record(self.fields, pool[slot])
            specs = {(s.mode, s.bits, s.group_size) for s in (self.quant[p] for p in PROJECTIONS)}
            if pool.device.type == "cpu" and len(specs) == 1 and self.quant["gate_proj"].quantized and \
                    self.quant["gate_proj"].mode == "affine":
                spec = self.quant["gate_proj"]  # all three in one pass, each with dequantize's bits
                parts = [(record[f"{p}.weight"], record[f"{p}.scales"], record[f"{p}.biases"]) for p in PROJECTIONS]
                return tuple(dequantize_many(parts, spec.bits, spec.group_size, self.x.dtype))
            return tuple(projection(record, p, self.quant[p], self.x.dtype) for p in PROJECTIONS)

        if self.unpacked is None or pool.device.type != "cpu":
            return unpack()
        return self.unpacked.get(self.layer, e, slot, unpack)

    def expert_rows(self, pool: torch.Tensor, e: int, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Expert e's weighted output rows (in `out`'s dtype) for the pairs that chose it: (tok, pick,
        rows), rows[i] for token tok[i] at its pick[i]-th choice. Expert parallelism adds them elsewhere."""
        g, u, d = self.matrices(pool, e, slot)
        ffn = self.ffn
        if self.biased:
            spec = self.quant["gate_proj"]
            record = decode_record(self.fields, pool[slot])
            biases = tuple(record[f"{p}.bias"].to(self.x.dtype) for p in ("gate_proj", "up_proj", "down_proj"))
            ffn = functools.partial(self.ffn, biases=biases, alpha=spec.alpha, limit=spec.limit)
        tok, pick = torch.where(self.ids == e)
        if self.per_pair:
            y = torch.cat([ffn(self.x[t:t + 1], g, u, d) for t in tok.tolist()])
        else:
            y = ffn(self.x[tok], g, u, d)
        return tok, pick, (y * self.weights[tok, pick, None]).to(self.out.dtype)

    def _rows_at_once(self) -> bool:
        """Whether `_run_rows` gives each pair the bits of its own one-row products: CPU, SwiGLU
        without biases, products `rows_exact` takes, and an intermediate size whose SiLU rows fall
        on whole vectors (torch computes a vector's tail with other exp code) in one thread's range."""
        x = self.x
        if x.device.type != "cpu" or self.ffn is not swiglu or self.biased or self.out.dtype != x.dtype:
            return False
        inter = next(f.shape[0] for f in self.fields if f.name == "gate_proj.weight")
        H = x.shape[1]
        return (rows_exact(x.dtype, H, inter) and rows_exact(x.dtype, inter, H) and inter % SILU_VECTOR == 0
                and (torch.get_num_threads() == 1 or self.ids.numel() * inter < SERIAL_ELEMENTS))

    def _run_rows(self, pool: torch.Tensor, todo: list[tuple[int, int]]) -> None:
        """per_pair for all pairs of these experts at once: pairs ordered by expert (ascending), then
        token, so the one index_add adds each token's experts in `run`'s order; per expert one
        batched call per projection (`rows_linear`), the activation once for all pairs."""
        A = self.ids.shape[1]
        flat = self.ids.reshape(-1).tolist()
        wanted = {e for e, _ in todo}
        by_expert: dict[int, list[int]] = {}
        for p, e in enumerate(flat):
            if e in wanted:
                by_expert.setdefault(e, []).append(p)
        order = [p for e, _ in todo for p in by_expert[e]]
        pairs = torch.tensor(order, dtype=torch.long)
        tok = pairs // A
        xs = self.x.index_select(0, tok)  # [P, H]
        mats = [self.matrices(pool, e, slot) for e, slot in todo]
        P, H, inter = len(order), xs.shape[1], mats[0][0].shape[0]
        gate = xs.new_empty((P, 1, inter))
        up = xs.new_empty((P, 1, inter))
        y = xs.new_empty((P, 1, H))
        at = 0
        for (e, _), (g, u, _) in zip(todo, mats):
            n = len(by_expert[e])
            rows_linear(xs[at:at + n], g, out=gate[at:at + n])
            rows_linear(xs[at:at + n], u, out=up[at:at + n])
            at += n
        h = (F.silu(gate) * up).view(P, inter)
        at = 0
        for (e, _), (_, _, d) in zip(todo, mats):
            n = len(by_expert[e])
            rows_linear(h[at:at + n], d, out=y[at:at + n])
            at += n
        w = self.weights.reshape(-1).index_select(0, pairs)
        self.out.index_add_(0, tok, (y.view(P, H) * w[:, None]).to(self.out.dtype))

    def run_table(self, pool: torch.Tensor, table: torch.Tensor) -> None:
        experts = torch.unique(self.ids).tolist()
        slots = table[experts].tolist()
        self.run(pool, experts, slots)

    def take_rows(self, rows: torch.Tensor, table: torch.Tensor) -> None:
        """Add rows[p] (float32 [>= T*A, H], pair p = t*A + a) for the pairs whose expert has no
        slot in `table`: their weighted outputs, computed elsewhere."""
        flat = self.ids.reshape(-1)
        elsewhere = table[flat] < 0
        if bool(elsewhere.any()):
            pairs = torch.nonzero(elsewhere)[:, 0]
            self.out.index_add_(0, pairs // self.ids.shape[1], rows[pairs].to(self.out.dtype))

    def finish(self, residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        y = self.out if residual is None else residual + self.out
        if out is not None:
            out.copy_(y)
            return out
        return y
