"""Expert parallelism: each rank holds and computes only its share of every MoE layer's experts.

Legend: T tokens, H hidden, A experts per token, P = T * A (token, expert) pairs.

Every rank runs the whole model (attention replicated, one sequence). At an MoE layer each rank
computes the weighted rows [P, H] of the pairs whose expert it owns; the ranks all-gather them, take
every pair's row from its owner's copy (a selection, no arithmetic) and add the rows as one process
does (NativePlan's or TorchPlan's order): every rank's output is the single-process output bit for
bit, for any number of ranks and any placement. `OwnedExperts` keeps a rank to its own records."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import torch
import torch.distributed as dist

from moestream.errors import MoestreamError
from moestream.layers.native_experts import NativePlan
from moestream.layers.torch_experts import TorchPlan


class ExpertParallelError(MoestreamError):
    """A collective of expert parallelism failed: another rank stopped, or it timed out."""


@dataclass
class ExpertGroup:
    """The ranks computing experts together (an initialized torch.distributed process group)."""

    rank: int
    world_size: int
    group: object = None  # a torch.distributed ProcessGroup; None: the default group
    timeout_s: float = 0.0  # the group's collective timeout, for error messages
    collective_s: float = 0.0  # time spent in exchanges (on CUDA including the wait for the device)
    exchanges: int = 0

    def all_gather(self, rows: torch.Tensor, *, layer: int) -> list[torch.Tensor]:
        """Every rank's `rows`, by rank. A failure (a rank that stopped, the timeout) becomes one line."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(rows) for _ in range(self.world_size)]
        try:
            dist.all_gather(parts, rows.contiguous(), group=self.group)
            if rows.device.type == "cuda":
                torch.cuda.synchronize(rows.device)
        except (RuntimeError, ValueError) as exc:  # DistBackendError and the store's errors are RuntimeErrors
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise ExpertParallelError(
                f"rank {self.rank}: the expert exchange of layer {layer} failed (another rank stopped, or no "
                f"answer within {self.timeout_s:g} s): {first}") from None
        self.collective_s += time.perf_counter() - t0
        self.exchanges += 1
        return parts

    def all_gather_object(self, obj) -> list:
        out = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except (RuntimeError, ValueError) as exc:
            raise ExpertParallelError(f"rank {self.rank}: gathering the ranks' statistics failed: "
                                      f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}") from None
        return out


def owners_by_modulo(num_experts: int, world_size: int) -> list[int]:
    """Expert e on rank e % world_size."""
    return [e % world_size for e in range(num_experts)]


def owners_balanced(counts: Sequence[int], world_size: int) -> list[int]:
    """Greedy by load: experts from most to least used (ties: lower id first), each to the rank with
    the least load so far (ties: fewer experts, then lower rank)."""
    load, held = [0] * world_size, [0] * world_size
    owners = [0] * len(counts)
    for e in sorted(range(len(counts)), key=lambda e: (-int(counts[e]), e)):
        r = min(range(world_size), key=lambda r: (load[r], held[r], r))
        owners[e] = r
        load[r] += int(counts[e])
        held[r] += 1
    return owners


@dataclass
class ExpertPlacement:
    """Which rank owns each expert of each MoE layer."""

    owners: dict[int, list[int]]  # layer -> [E] rank
    source: str = "modulo"  # modulo, or the routing trace the balance came from
    _tensors: dict = field(default_factory=dict, repr=False)

    @classmethod
    def modulo(cls, num_experts: Mapping[int, int], world_size: int) -> "ExpertPlacement":
        return cls({layer: owners_by_modulo(e, world_size) for layer, e in num_experts.items()})

    @classmethod
    def from_routes(cls, layers: np.ndarray, experts: np.ndarray, num_experts: Mapping[int, int], world_size: int, *,
                    path: str) -> "ExpertPlacement":
        """Balanced by each layer's expert counts in a routing trace's rows (moestream.experts.trace:
        layers [N], experts [N, A]) read from `path`."""
        if len(layers) == 0:
            raise MoestreamError(f"expert placement: the routing trace {path} is empty")
        owners = {}
        for layer, e in num_experts.items():
            chosen = experts[layers == layer].ravel()  # a layer the trace lacks: all counts 0
            if chosen.size and (int(chosen.min()) < 0 or int(chosen.max()) >= e):
                raise MoestreamError(f"expert placement: the routing trace {path} names expert {int(chosen.max())} "
                                     f"of layer {layer}, which has {e} experts (a trace of another model?)")
            owners[layer] = owners_balanced(np.bincount(chosen, minlength=e).tolist(), world_size)
        return cls(owners, source=str(path))

    def owned(self, layer: int, rank: int) -> list[int]:
        return [e for e, r in enumerate(self.owners[layer]) if r == rank]

    def count(self, rank: int) -> int:
        return sum(len(self.owned(layer, rank)) for layer in self.owners)

    def owner_tensor(self, layer: int, device: torch.device) -> torch.Tensor:
        key = (layer, str(device))
        if key not in self._tensors:
            self._tensors[key] = torch.tensor(self.owners[layer], dtype=torch.long, device=device)
        return self._tensors[key]


class OwnedExperts:
    """The rank's expert provider, limited to the experts it owns: early reads of other experts are
    dropped, and a fetch of one is a bug (an error). Everything else is the wrapped cache's."""

    def __init__(self, provider, placement: ExpertPlacement, rank: int):
        self.provider, self.placement, self.rank = provider, placement, rank
        self._mine = {layer: set(placement.owned(layer, rank)) for layer in placement.owners}

    def __getattr__(self, name):  # everything else RoutedExperts asks of the cache, and its own attributes
        return getattr(self.provider, name)

    def fetch(self, layer: int, experts: Sequence[int], *, views: bool = True):
        other = [e for e in experts if e not in self._mine[layer]]
        if other:
            raise RuntimeError(f"rank {self.rank} asked for expert {other[0]} of layer {layer}, owned by rank "
                               f"{self.placement.owners[layer][other[0]]}")
        return self.provider.fetch(layer, experts, views=views)

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        mine = [e for e in experts if e in self._mine[layer]]
        return self.provider.prefetch(layer, mine) if mine else 0

    def can_hold_all(self) -> bool:
        return False  # residency of a rank's share is not wired: every layer takes the host half

    def make_resident(self) -> bool:
        return False

    def resident_table(self, layer: int):
        return None


@dataclass
class ExpertParallel:
    """What RoutedExperts needs to run expert parallel: the group and the placement."""

    group: ExpertGroup
    placement: ExpertPlacement

    def mine(self, layer: int, experts: Sequence[int]) -> list[int]:
        owners = self.placement.owners[layer]
        return [e for e in experts if owners[e] == self.group.rank]


class ExpertParallelPlan:
    """One process's plan split over ranks (see the module doc): NativePlan's arithmetic where the
    native kernels take the records (`native`: their layout), else TorchPlan's; `run` takes owned
    experts only."""

    def __init__(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, fields, quant, *,
                 per_pair: bool, parallel: ExpertParallel, layer: int, native: torch.Tensor | None = None):
        self.parallel, self.layer, self.ids = parallel, layer, ids
        T, A = ids.shape
        self.A = A
        if native is not None:
            self.local = NativePlan(x, ids, weights, native, threads=torch.get_num_threads())
            self.rows = self.local.pair_rows()  # [P, H], its own rows
        else:
            self.local = TorchPlan(x, ids, weights, fields, quant, per_pair=per_pair)
            self.rows = torch.zeros((T * A, x.shape[-1]), dtype=self.local.out.dtype, device=x.device)  # [P, H]

    def run(self, pool: torch.Tensor, experts: Sequence[int], slots: Sequence[int]) -> None:
        if isinstance(self.local, NativePlan):
            self.local.run(pool, experts, slots)
            return
        for e, slot in sorted(zip(experts, slots)):
            tok, pick, rows = self.local.expert_rows(pool, e, slot)
            self.rows[tok * self.A + pick] = rows

    def run_table(self, pool: torch.Tensor, table: torch.Tensor) -> None:
        experts = self.parallel.mine(self.layer, torch.unique(self.ids).tolist())
        self.run(pool, experts, table[experts].tolist())

    def finish(self, residual: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        parts = self.parallel.group.all_gather(self.rows, layer=self.layer)  # world x [P, H]
        owner = self.parallel.placement.owner_tensor(self.layer, self.ids.device)[self.ids.reshape(-1)]  # [P]
        rows = torch.stack(parts)[owner, torch.arange(owner.shape[0], device=owner.device)]  # [P, H]
        if isinstance(self.local, NativePlan):
            self.local.rows = rows  # every pair's row: added as one process adds them
            return self.local.finish(residual, out)
        for e in torch.unique(self.ids).tolist():  # ascending, as TorchPlan adds them
            tok, pick = torch.where(self.ids == e)
            self.local.out.index_add_(0, tok, rows[tok * self.A + pick])
        return self.local.finish(residual, out)
