"""The CPU's routed experts straight from the packed records in the slot pool (NativePlan): the native
kernels of moestream.cpu_share.kernels on the activations `kernels.activations()` names (int8 per 32
inputs where the CPU has AVX-512 VNNI, as the resident matrices' products; float32 elsewhere), no
dequantized copy of any expert: SwiGLU records, and gpt-oss's clamped SwiGLU ones with their added biases,
affine or MXFP4 (gpt-oss's own codes).

Each (token, expert) pair's weighted row is computed on its own from the record's codes, scales and
biases (w = scale·q + bias, or e2m1(q)·2^(e - 127)), so a row's bits depend neither on the other pairs, nor on how the
experts are batched or which slot holds them, nor on the team's size; a token's rows are then added
in the order of its picks. On the float rows the products differ from the dequantized reference
(TorchPlan) only in float32 rounding (the order of the sums: tests/unit/test_native_plan.py bounds
it); the int8 rows are within about 1 % of them (tests/unit/test_native_int8.py)."""
from __future__ import annotations

from typing import Sequence

import torch

from moestream.cpu_share import kernels as native
from moestream.quant.affine import QuantSpec


def native_layout(fields, quant) -> torch.Tensor | None:
    """The native kernels' layout of a layer's records, or None where they cannot compute them (no
    build here, or a layout they refuse): the torch reference (TorchPlan) runs those."""
    if native.refusal(fields, quant) is not None or native.load() is None:
        return None
    return native.layout(fields, quant)


def takes_every_layer(packed) -> bool:
    """Whether the native kernels compute every expert layer's records of a packed model here (then
    the CPU keeps no dequantized copies: moestream.experts.unpacked)."""
    return all(native_layout(e.fields, {p: QuantSpec.from_json(s) for p, s in e.quant.items()}) is not None
               for e in packed.manifest.expert_layers)


class NativePlan:
    """Routed experts of one layer call from the pool's records, with MoEPlan's interface (`run`,
    `run_table`, `take_rows`, `finish`). With the slot table, one native call computes every pair and
    each token's sum into `out` (`expert_sum`). In batches of experts (`run`: more distinct experts
    than the pool pins at once; expert parallelism), each pair's weighted row goes into `rows`
    [T * A, H] (pair t * A + a, zero where not computed) and `finish` adds a token's rows as
    expert_sum does: the same float32 adds in the same order, so the same bits."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, layout: torch.Tensor, *,
                 threads: int):
        self.x, self.ids, self.layout, self.threads = x, ids, layout, threads
        self.x32 = x.to(torch.float32).contiguous()
        self.weights = weights.to(torch.float32).contiguous()
        self.module = native.load()
        self.out = torch.zeros_like(self.x32)  # [T, H] each token's experts added (float32)
        self.rows: torch.Tensor | None = None

    def run_table(self, pool: torch.Tensor, table: torch.Tensor) -> None:
        """Every pair, its expert's slot from `table` (int32 [E]; < 0: computed elsewhere, `take_rows`)."""
        self.module.expert_sum(self.layout, pool, table, self.ids.to(torch.int64).contiguous(), self.weights,
                               self.x32, self.out, self.threads)

    def pair_rows(self) -> torch.Tensor:
        """[T * A, H] float32: each pair's weighted row where `run` computed it, else zero."""
        if self.rows is None:
            self.rows = torch.zeros((self.ids.numel(), self.x.shape[1]), dtype=torch.float32)
        return self.rows

    def run(self, pool: torch.Tensor, experts: Sequence[int], slots: Sequence[int]) -> None:
        """The pairs of `experts` (their slots in `slots`) into `pair_rows`; the others come in other calls."""
        A = self.ids.shape[1]
        slot_of = dict(zip(experts, slots))
        flat = self.ids.reshape(-1).tolist()
        pairs = [p for p, e in enumerate(flat) if e in slot_of]
        if not pairs:
            return
        chosen = sorted({flat[p] for p in pairs})
        index = {e: i for i, e in enumerate(chosen)}
        addresses = torch.tensor([pool[slot_of[e]].data_ptr() for e in chosen], dtype=torch.int64)
        rows = torch.empty((len(pairs), self.x.shape[1]), dtype=torch.float32)
        self.module.weighted_rows(self.layout, addresses, torch.tensor([index[flat[p]] for p in pairs], dtype=torch.int32),
                                  torch.tensor([p // A for p in pairs], dtype=torch.int32),
                                  self.weights.reshape(-1)[pairs], self.x32, rows, self.threads)
        self.pair_rows()[pairs] = rows

    def take_rows(self, rows: torch.Tensor, table: torch.Tensor) -> None:
        """Add rows[p] (float32 [>= T*A, H]) for the pairs whose expert has no slot in `table`: their
        weighted outputs, computed elsewhere (a CPU share on the CPU device)."""
        elsewhere = table[self.ids.reshape(-1)] < 0
        if bool(elsewhere.any()):
            pairs = torch.nonzero(elsewhere)[:, 0]
            self.out.index_add_(0, pairs // self.ids.shape[1], rows[pairs])

    def finish(self, residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        if self.rows is not None:
            T, A = self.ids.shape
            rows = self.rows.view(T, A, -1)
            self.out = rows[:, 0].clone()
            for a in range(1, A):  # a token's rows in the order of its picks, whatever T
                self.out += rows[:, a]
        y = self.out.to(self.x.dtype)
        if residual is not None:
            y = residual + y
        if out is not None:
            out.copy_(y)
            return out
        return y
