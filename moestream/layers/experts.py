"""RoutedExperts: the one place where routed experts are computed.

Legend: T tokens, H hidden, A experts per token, E experts of a layer, U distinct experts chosen.

It has two halves:
  - the host half makes the chosen experts available: it asks the provider (the slot cache) to
    pin them, loading misses, and writes the layer's slot table; it calls the trace and prefetch
    hooks. It is the only part that may synchronize with the device (to read the chosen ids).
  - the device half computes y = sum_a weights[t, a] * FFN_{ids[t, a]}(x[t]) from the slot pool and
    a slot table. With the Triton kernels it reads no device value on the host, so the CUDA
    decoder captures it in a graph.

Kernels behind it: the Triton slot-pool kernels (CUDA, 4/8-bit records in the MLX layout and MXFP4
records, every gated activation of torch_experts.ACTIVATIONS with its biases) and the torch reference
(moestream.layers.torch_experts: the CPU, and any record layout the Triton kernels do not take, e.g.
unquantized experts). Which one a layer uses depends only on the device, the option and the record
layout, never on what is cached, so the bits are the same for every cache size and policy.

Where other backends plug in: a backend that computes some experts elsewhere (the CPU beside the
GPU, or other ranks in expert parallelism) is a `plan` whose `run` takes the experts it owns and a
`finish` that adds their partial sums in a fixed order; the host half decides who computes which
expert before `run`. Nothing above this class changes."""
from __future__ import annotations

import logging
from typing import Callable, Mapping, Protocol, Sequence

import torch

from moestream.kernels.expert_layout import ACT_DTYPES, SlotLayout, UnsupportedLayout
from moestream.layers.torch_experts import TorchPlan, activation_of
from moestream.quant.affine import QuantSpec

log = logging.getLogger(__name__)

KERNELS = ("auto", "torch", "triton")


def padding_on_last_row(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """ids [T, A] with the rows past `last` ([1], a padded prefill's last real row, on the device: a
    graph's input) routed to that row's experts, so the padding reads no expert the prompt did not.
    The real rows keep their bits: the expert kernels choose tiles for the real token count and the
    padding's pairs sort after the real ones; the padding's outputs reach only K/V past the prompt,
    which later tokens overwrite."""
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    return torch.where(rows > last, ids.index_select(0, last), ids)


class ExpertProvider(Protocol):
    """Where routed-expert records live: a pool of slots, filled on demand (moestream.experts.cache)."""

    total_experts: int

    def quant(self, layer: int) -> dict[str, QuantSpec]: ...

    def record_fields(self, layer: int) -> list: ...

    def slot_pool(self, layer: int) -> torch.Tensor:
        """uint8 [slots, slot_bytes]: the tensor `slots_of` indexes."""
        ...

    def fetch(self, layer: int, experts: Sequence[int], *, views: bool = True) -> Mapping[int, dict]:
        """Pin the experts' slots (loading misses); they stay valid until `release(layer)`."""
        ...

    def slots_of(self, layer: int, experts: Sequence[int]) -> list[int]: ...

    def release(self, layer: int) -> None: ...

    def batch_limit(self, layer: int) -> int:
        """The most experts of `layer` that can be pinned at once; more are computed in batches."""
        ...

    def prefetch(self, layer: int, experts: Sequence[int]) -> int: ...

    def can_hold_all(self) -> bool: ...

    def make_resident(self) -> bool: ...

    def start_device_map(self):
        """A moestream.experts.device_map.DeviceMap over this pool (device-driven streaming)."""
        ...

    def resident_table(self, layer: int) -> torch.Tensor | None: ...

    def count_resident(self, layer: int, ids: torch.Tensor) -> None: ...

    def stats(self) -> dict: ...

    def close(self) -> None: ...


class RoutedExperts:
    """Computes every MoE layer's routed experts from the provider's slot pool (see the module doc)."""

    def __init__(self, provider: ExpertProvider, moe_layers: Mapping[int, int], *, device: torch.device,
                 kernels: str = "auto", parallel=None):
        """moe_layers: layer index -> number of experts. kernels: "auto" (Triton where the layout
        allows on CUDA), "torch" (always the reference) or "triton" (an error where it cannot run).
        parallel: a moestream.layers.expert_parallel.ExpertParallel: this rank computes only its own
        experts, and the ranks exchange their rows (the torch reference's arithmetic, exactly)."""
        if kernels not in KERNELS:
            raise ValueError(f"expert kernels {kernels!r} (choose from {', '.join(KERNELS)})")
        if parallel is not None and kernels == "triton":
            raise RuntimeError("the Triton expert kernels do not run expert parallel (use --expert-kernels auto or torch)")
        self.provider, self.num_experts, self.device = provider, dict(moe_layers), torch.device(device)
        self.kernels = "torch" if parallel is not None else kernels
        self.parallel = parallel
        self.layouts = {layer: self._layout(layer) for layer in self.num_experts}
        self.tables = {layer: torch.full((e,), -1, dtype=torch.int32, device=self.device)
                       for layer, e in self.num_experts.items()}  # the decoder's per-layer slot tables
        pin = self.device.type == "cuda"
        # host copies the tables are written from (pinned on CUDA: the copy runs without waiting)
        self._host_tables = {layer: (t.cpu().pin_memory() if pin else t.cpu()) for layer, t in self.tables.items()}
        self.resident = False
        # the CPU's kept unpacked experts (moestream.experts.unpacked.UnpackedExperts), or None
        self.unpacked = None
        self.device_map = None  # set by start_device_map: the device looks up slots and copies misses itself
        self.cpu = None  # a moestream.layers.cpu_share.CpuShare: the CPU computes some misses
        # on the device-driven path, the CPU's share through a mailbox (moestream.layers.device_cpu_share)
        self.device_share = None
        self.device_lookahead = None  # and its early copies (moestream.experts.device_lookahead)
        self._cpu_jobs: dict = {}  # layer -> its CpuJob between `load` and `join_cpu`
        self._cpu_rows: dict = {}  # (pairs, H) -> (device float32 rows the plans take, host staging)
        # hooks: on_route(layer, ids) sees every layer's chosen ids (traces); after_fetch(layer, x,
        # chosen) runs once a layer's experts are pinned (early reads for later layers start there;
        # chosen: the distinct experts the layer routed to, to score earlier guesses)
        self.on_route: Callable[[int, torch.Tensor], None] | None = None
        self.after_fetch: Callable[[int, torch.Tensor, list[int]], None] | None = None
        # benchmarks only (moestream.bench.routing): (layer, weights, ids) -> replaced weights, ids
        self.reroute: Callable | None = None
        # while a padded prefill chunk runs (moestream.engine.prefill_graphs): its real token count
        # (MoEPlan's tile_tokens), its last real row ([1] on the device; the padding takes that row's
        # experts), and the list that takes each resident layer's (layer, ids) in place of counting its
        # hits there (booked after each run, for the real rows)
        self.tile_tokens: int | None = None
        self.last_real_row: torch.Tensor | None = None
        self.booked: list | None = None

    # -- which kernels -------------------------------------------------------------------------
    def _layout(self, layer: int):
        """The Triton SlotLayout of `layer`'s records, or None where the torch reference runs them."""
        if self.kernels == "torch" or self.device.type != "cuda":
            return None
        quant = self.provider.quant(layer)
        activation_of(quant)  # an unknown activation is an error, not a fallback
        reason = None
        try:
            from moestream.kernels import triton_moe
        except ImportError as exc:
            triton_moe, reason = None, f"Triton is not installed ({exc})"
        if triton_moe is not None:
            try:
                return SlotLayout.from_fields(self.provider.record_fields(layer), quant)
            except UnsupportedLayout as exc:
                reason = str(exc)
        if self.kernels == "triton":
            raise RuntimeError(f"layer {layer}: the Triton expert kernels cannot run: {reason}")
        log.info("layer %d: torch reference for routed experts (%s)", layer, reason)
        return None

    def uses_triton(self, layer: int, dtype: torch.dtype) -> bool:
        return self.layouts[layer] is not None and dtype in ACT_DTYPES

    def plan(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, per_pair: bool = False,
             split_x: torch.Tensor | None = None):
        """The device half's work for one layer call: Triton's MoEPlan or the torch reference.
        per_pair: a token's bits must not depend on how many tokens are computed together.
        split_x: x as the Triton gemv kernels read it (MoEPlan's split_x), already written."""
        if self.parallel is not None:
            from moestream.layers.expert_parallel import ExpertParallelPlan

            return ExpertParallelPlan(x, ids, weights, self.provider.record_fields(layer), self.provider.quant(layer),
                                      per_pair=per_pair, parallel=self.parallel, layer=layer)
        if self.uses_triton(layer, x.dtype):
            from moestream.kernels import triton_moe

            return triton_moe.MoEPlan(x, ids, weights, self.num_experts[layer], self.layouts[layer],
                                      mode="gemv" if per_pair else "auto", tile_tokens=self.tile_tokens,
                                      split_x=split_x)
        return TorchPlan(x, ids, weights, self.provider.record_fields(layer), self.provider.quant(layer),
                         per_pair=per_pair, unpacked=self.unpacked, layer=layer)

    # -- both halves, eagerly ------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                 residual: torch.Tensor | None = None, per_pair: bool = False, notify: bool = True,
                 out: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
        """sum_a weights[t, a] * FFN_{ids[t, a]}(x[t]) (+ residual), for x [T, H], ids/weights [T, A].
        out, norm: as `compute` (the Triton kernels only).

        Where every expert is resident the kernels index the resident table (no lookup, no sync).
        Else the distinct ids come to the host (the one sync) and are pinned in batches of at most
        `batch_limit`; each batch computes only its own pairs, so batching never changes the bits."""
        if notify and self.on_route is not None:
            self.on_route(layer, ids)
        if self.last_real_row is not None:
            ids = padding_on_last_row(ids, self.last_real_row)
        plan = self.plan(layer, x, ids, weights, per_pair=per_pair)
        pool = self.provider.slot_pool(layer)
        if self.device_map is not None:
            self.device_map.ensure(layer, ids)
            plan.run_table(pool, self.tables[layer])
            return self.finish_plan(plan, residual, out, norm)
        table = self.provider.resident_table(layer)
        if table is not None:
            plan.run_table(pool, table)
            if self.booked is not None:
                self.booked.append((layer, ids))
            else:
                self.provider.count_resident(layer, ids)
            return self.finish_plan(plan, residual, out, norm)
        experts = chosen = torch.unique(ids).tolist()  # sorted
        if self.parallel is not None:  # this rank's share; the plan's finish brings the others' rows
            experts = self.parallel.mine(layer, experts)
            if not experts and self.after_fetch is not None:
                self.after_fetch(layer, x, chosen)
        limit = max(1, self.provider.batch_limit(layer))
        for i in range(0, len(experts), limit):
            batch = experts[i:i + limit]
            self.provider.fetch(layer, batch, views=False)
            if i == 0 and self.after_fetch is not None:
                self.after_fetch(layer, x, chosen)
            try:
                plan.run(pool, batch, self.provider.slots_of(layer, batch))
            finally:  # a victim slot is rewritten only after the work queued above (stream order)
                self.provider.release(layer)
        return self.finish_plan(plan, residual, out, norm)

    @staticmethod
    def finish_plan(plan, residual: torch.Tensor | None, out: torch.Tensor | None, norm: tuple | None) -> torch.Tensor:
        """plan.finish, passing out and norm only where given (the torch reference takes neither)."""
        extra = {k: v for k, v in (("out", out), ("norm", norm)) if v is not None}
        return plan.finish(residual, **extra)

    # -- a CPU share of the misses -------------------------------------------------------------
    def share_with_cpu(self, share, *, dtype: torch.dtype, timeout_s: float, threads: int = 0) -> None:
        """Let the CPU compute a share of each streamed layer's misses from host RAM (see
        moestream.layers.cpu_share): "auto" or a float in 0..1."""
        if self.parallel is not None:
            raise RuntimeError("--cpu-experts does not run with expert parallelism")
        from moestream.layers.cpu_share import CpuShare

        self.cpu = CpuShare(self.provider, list(self.num_experts), share=share, dtype=dtype, timeout_s=timeout_s,
                            threads=threads)

    def _rows_buffers(self, pairs: int, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The device rows every layer's plan takes CPU rows from (one per shape: a CUDA graph binds
        it), and its host staging. Layers share them: a layer's copy in is queued after the previous
        layer's experts, and its staging is written only after the host has waited for those."""
        key = (pairs, hidden)
        if key not in self._cpu_rows:
            dev = torch.zeros((pairs, hidden), dtype=torch.float32, device=self.device)
            host = torch.zeros((pairs, hidden), dtype=torch.float32)
            self._cpu_rows[key] = (dev, host.pin_memory() if self.device.type == "cuda" else host)
        return self._cpu_rows[key]

    def join_cpu(self, layer: int) -> None:
        """After `load`: wait for the layer's CPU share and stage its rows for the experts segment;
        where it failed or timed out, load its experts on the device instead. Writes the layer's table."""
        job = self._cpu_jobs.pop(layer, None)
        if job is None:
            return
        from moestream.layers.cpu_share import CpuShareFailed

        host = self._host_tables[layer]
        try:
            rows = self.cpu.wait(job)
        except CpuShareFailed:
            self.provider.fetch(layer, job.experts, views=False)
            host[job.experts] = torch.tensor(self.provider.slots_of(layer, job.experts), dtype=torch.int32)
        else:
            self.provider.count_misses(layer, len(job.experts))
            dev, staging = self._rows_buffers(job.total, rows.shape[1])
            staging[job.pairs] = rows
            dev.copy_(staging, non_blocking=True)
        self.tables[layer].copy_(host, non_blocking=True)

    def look_ahead_on_device(self, top_k: dict[int, int], depth: int) -> None:
        """With the device map running: early copies of the next `depth` MoE layers' guessed experts
        (moestream.experts.device_lookahead; top_k: layer -> experts a guess names); the decoder
        hands the guesses to `compute`."""
        from moestream.experts.device_lookahead import DeviceLookahead

        self.device_lookahead = DeviceLookahead(self.device_map, top_k, depth=depth)

    def share_on_device(self, *, hidden: int, dtype: torch.dtype, max_tokens: int, timeout_s: float) -> None:
        """With the device map running: the CPU's share of the misses through a mailbox the device
        posts to and waits on inside the step's graph (moestream.layers.device_cpu_share)."""
        from moestream.layers.device_cpu_share import DeviceCpuShare

        self.device_share = DeviceCpuShare(self.cpu, device=self.device, hidden=hidden, max_tokens=max_tokens,
                                           dtype=dtype, timeout_s=timeout_s, device_map=self.device_map)

    def _take_cpu_rows(self, layer: int, plan, ids: torch.Tensor, hidden: int, table: torch.Tensor) -> None:
        if self.cpu is not None and self.device_map is None and not self.cpu.refused.get(layer):
            plan.take_rows(self._rows_buffers(ids.numel(), hidden)[0], table)

    # -- the halves apart (the decoder) --------------------------------------------------------
    def make_resident(self) -> bool:
        """Where the pool holds every expert: load them all and fill the slot tables for good (then
        `load` is never needed and a whole step can be one CUDA graph)."""
        if not self.resident and self.provider.can_hold_all() and self.provider.make_resident():
            for layer, table in self.tables.items():
                table.copy_(self.provider.resident_table(layer))
            self.resident = True
        return self.resident

    def start_device_map(self) -> None:
        """Device-driven streaming (moestream.experts.device_map): from now on each layer call finds
        or copies its experts on the device, so a streamed step needs the host no more than a
        resident one. Raises DeviceMapUnavailable where it cannot run."""
        if self.device_map is None:
            dm = self.provider.start_device_map()
            for layer in self.tables:
                self.tables[layer] = dm.layer_table(layer)
            self.device_map = dm

    @property
    def device_driven(self) -> bool:
        """Whether a layer call needs no host half: every expert resident, or the device map drives."""
        return self.resident or self.device_map is not None

    def load(self, layer: int, ids_host: list[int], x: torch.Tensor | None = None,
             weights: torch.Tensor | None = None) -> bool:
        """Host half for the decoder: pin the distinct `ids_host` and write their slots into the
        layer's table. False (nothing pinned) where they exceed the batch limit: then the caller
        computes the layer eagerly (`__call__`), in batches. With a CPU share (and x, weights
        given), the CPU starts on its misses first; they are not loaded, and `join_cpu` finishes
        the table."""
        experts = chosen = sorted(set(ids_host))
        if self.parallel is not None:
            experts = self.parallel.mine(layer, experts)
        if len(experts) > self.provider.batch_limit(layer):
            return False
        job = None
        if self.cpu is not None and x is not None and weights is not None:
            job = self.cpu.start(layer, experts, ids_host, x, weights)
        if job is not None:
            job.total = len(ids_host)
            on_cpu = set(job.experts)
            experts = [e for e in experts if e not in on_cpu]
        clock = self.cpu.copy_clock() if self.cpu is not None else None
        copied = self.provider.host_bytes_copied if clock is not None else 0
        self.provider.fetch(layer, experts, views=False)
        if clock is not None:
            clock(self.provider.host_bytes_copied - copied)
        if self.after_fetch is not None and x is not None:
            self.after_fetch(layer, x, chosen)
        slots = self.provider.slots_of(layer, experts)
        # the previous step's copy from this host table was queued before the ids just read, so it is done
        host = self._host_tables[layer]
        host.fill_(-1)
        host[experts] = torch.tensor(slots, dtype=torch.int32)
        if job is None:
            self.tables[layer].copy_(host, non_blocking=True)
        else:
            self._cpu_jobs[layer] = job
        return True

    def release(self, layer: int) -> None:
        if not self.device_driven:
            self.provider.release(layer)

    def count_resident(self, layer: int, ids: torch.Tensor) -> None:
        """A resident layer ran without the host half: book its hits and tell the trace."""
        self.count_resident_step([(layer, ids)])

    def count_resident_step(self, routed: list[tuple[int, torch.Tensor]]) -> None:
        """count_resident for every MoE layer [(layer, ids)] of a step that ran without the host half."""
        many = getattr(self.provider, "count_resident_many", None)
        if many is not None:
            many(routed)
        else:
            for layer, ids in routed:
                self.provider.count_resident(layer, ids)
        if self.on_route is not None:
            for layer, ids in routed:
                self.on_route(layer, ids)

    def compute(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                per_pair: bool = True, ahead: list | None = None, split_x: torch.Tensor | None = None,
                norm: tuple | None = None) -> torch.Tensor:
        """Device half: the routed experts from the layer's slot table (set by `load`, resident, or
        brought up to date here by the device map). ahead: [(later MoE layer, guessed ids)] whose
        copies the device map starts beside this layer's kernels (device-driven path only).
        split_x, norm (the Triton kernels only): x already in the gemv kernels' input order
        (MoEPlan's split_x), and (weight, eps, normed) to write the next layer's input norm of the
        result into normed in the same last kernel (MoEPlan.finish)."""
        guessing = None
        if self.device_map is not None:
            if self.device_share is not None and self.device_share.takes(x, ids) and not self.cpu.refused.get(layer):
                return self.device_share.compute(self, layer, x, ids, weights, residual=residual, out=out,
                                                 split_x=split_x, norm=norm)
            guessing = self.device_lookahead if ahead else None
            if self.device_lookahead is not None:
                self.device_lookahead.score(layer, ids)
            self.device_map.ensure(layer, ids)
            if guessing is not None:
                guessing.fork(ahead)
        plan = self.plan(layer, x, ids, weights, per_pair=per_pair, split_x=split_x)
        plan.run_table(self.provider.slot_pool(layer), self.tables[layer])
        self._take_cpu_rows(layer, plan, ids, x.shape[1], self.tables[layer])
        if guessing is not None:
            guessing.join()
        return self.finish_plan(plan, residual, out, norm)
