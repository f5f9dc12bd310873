"""RoutedExperts: the one place where routed experts are computed.

Legend: T tokens, H hidden, A experts per token, E experts of a layer.

Its host half makes the chosen experts available (pins them in the provider's slots, loading misses,
writes the layer's slot table, calls the trace hook): the only part that may
synchronize with the device. Its device half computes y = sum_a weights[t, a] * FFN_{ids[t, a]}(x[t])
from the slot pool and a slot table, reading no device value on the host with the Triton kernels, so
the CUDA decoder captures it in a graph.

Kernels: Triton's slot-pool kernels (CUDA), the native CPU kernels (moestream.layers.native_experts)
and the torch reference (moestream.layers.torch_experts: expert parallelism, a CPU share's layers,
any record layout neither takes). Which one a layer uses depends only on the device, the record
layout and the build, never on what is cached: the same bits for every cache size and policy.
Backends and hooks are given when it is built, never set from outside."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Mapping

import torch

from moestream.cpu_share.share import CpuShare, ShareRequest, ShareUnavailable
from moestream.kernels.expert_layout import ACT_DTYPES, SlotLayout, UnsupportedLayout
from moestream.layers.native_experts import NativePlan, native_layout
from moestream.layers.torch_experts import TorchPlan, activation_of

log = logging.getLogger(__name__)


def padding_on_last_row(ids: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """ids [T, A] with the rows past `last` ([1] on the device: a padded prefill's last real row)
    routed to that row's experts, so the padding reads no expert the prompt did not
    (moestream.engine.prefill_graphs)."""
    rows = torch.arange(ids.shape[0], device=ids.device).unsqueeze(1)
    return torch.where(rows > last, ids.index_select(0, last), ids)


class RoutedExperts:
    """Computes every MoE layer's routed experts from the provider's slot pool (see the module doc)."""

    def __init__(self, provider, moe_layers: Mapping[int, int], *, device: torch.device, parallel=None,
                 unpacked=None, cpu_share: ShareRequest | None = None, on_route: Callable | None = None,
                 reroute: Callable | None = None):
        """provider: the slot pool filled on demand (moestream.experts.cache.ExpertCache, or
        expert parallelism's OwnedExperts over it); moe_layers: layer -> number of experts;
        parallel: moestream.layers.expert_parallel.ExpertParallel (this rank computes its own
        experts, the ranks exchange rows); unpacked: moestream.experts.unpacked.UnpackedExperts;
        cpu_share: the CPU's share of the misses, started with the device map. on_route(layer, ids)
        sees every layer's ids (a routing trace); reroute(layer, weights, ids) replaces the routing
        (benchmarks only: moestream.bench.routing)."""
        self.provider, self.num_experts, self.device = provider, dict(moe_layers), torch.device(device)
        self.parallel = parallel
        self.layouts = {layer: self._layout(layer) for layer in self.num_experts}
        # the CPU's native kernels, where they take the layer's records (else the torch reference)
        self.native = {layer: native_layout(provider.record_fields(layer), provider.quant(layer))
                       if self.device.type == "cpu" else None for layer in self.num_experts}
        self.tables = {layer: torch.full((e,), -1, dtype=torch.int32, device=self.device)
                       for layer, e in self.num_experts.items()}  # the decoder's per-layer slot tables
        pin = self.device.type == "cuda"
        # host copies the tables are written from (pinned on CUDA: the copy runs without waiting)
        self._host_tables = {layer: (t.cpu().pin_memory() if pin else t.cpu()) for layer, t in self.tables.items()}
        self.resident = False
        self.unpacked = unpacked
        self.device_map = None  # set by start_device_map: the device looks up slots and copies misses itself
        self.share_request = cpu_share
        self.cpu_share: CpuShare | None = None  # started with the device map, where the native worker runs
        self.on_route, self.reroute = on_route, reroute
        # set by `padded` while a padded prefill chunk runs
        self.tile_tokens: int | None = None
        self.last_real_row: torch.Tensor | None = None
        self.booked: list | None = None

    # -- which kernels -------------------------------------------------------------------------
    def _layout(self, layer: int):
        """The Triton SlotLayout of `layer`'s records, or None where the torch reference runs them."""
        if self.parallel is not None or self.device.type != "cuda":
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
                                      per_pair=per_pair, parallel=self.parallel, layer=layer,
                                      native=self.native[layer])
        if self.uses_triton(layer, x.dtype):
            from moestream.kernels import triton_moe

            return triton_moe.MoEPlan(x, ids, weights, self.num_experts[layer], self.layouts[layer],
                                      mode="gemv" if per_pair else "auto", tile_tokens=self.tile_tokens,
                                      split_x=split_x)
        if self.native[layer] is not None:
            return NativePlan(x, ids, weights, self.native[layer], threads=torch.get_num_threads())
        return TorchPlan(x, ids, weights, self.provider.record_fields(layer), self.provider.quant(layer),
                         per_pair=per_pair, unpacked=self.unpacked, layer=layer)

    # -- both halves, eagerly ------------------------------------------------------------------
    def __call__(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                 residual: torch.Tensor | None = None, per_pair: bool = False, notify: bool = True,
                 out: torch.Tensor | None = None, norm: tuple | None = None) -> torch.Tensor:
        """Both halves for x [T, H], ids/weights [T, A] (+ residual); out, norm: as `compute`. Streamed,
        the distinct ids come to the host (the one sync) and are pinned in batches of at most
        `batch_limit`, each computing only its own pairs: batching never changes the bits."""
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
        experts = torch.unique(ids).tolist()  # sorted
        if self.parallel is not None:  # this rank's share; the plan's finish brings the others' rows
            experts = self.parallel.mine(layer, experts)
        limit = max(1, self.provider.batch_limit(layer))
        for i in range(0, len(experts), limit):
            batch = experts[i:i + limit]
            self.provider.fetch(layer, batch, views=False)
            try:
                plan.run(pool, batch, self.provider.slots_of(layer, batch))
            finally:  # a victim slot is rewritten only after the work queued above (stream order)
                self.provider.release(layer)
        return self.finish_plan(plan, residual, out, norm)

    @contextmanager
    def quiet(self):
        """Calls that stay out of routing traces (a drafter's)."""
        saved, self.on_route = self.on_route, None
        try:
            yield
        finally:
            self.on_route = saved

    @contextmanager
    def padded(self, tokens: int, last_real_row: torch.Tensor, booked: list):
        """Calls of a padded prefill chunk (moestream.engine.prefill_graphs): the kernels choose their
        tiles for its `tokens` real rows (MoEPlan's tile_tokens), the padding takes the experts of the
        last real row ([1] on the device), and each resident layer's (layer, ids) goes to `booked` in
        place of counting its hits (the caller books the real rows after the run)."""
        self.tile_tokens, self.last_real_row, self.booked = tokens, last_real_row, booked
        try:
            yield
        finally:
            self.tile_tokens = self.last_real_row = self.booked = None

    @staticmethod
    def finish_plan(plan, residual: torch.Tensor | None, out: torch.Tensor | None, norm: tuple | None) -> torch.Tensor:
        """plan.finish, passing out and norm only where given (the torch reference takes neither)."""
        extra = {k: v for k, v in (("out", out), ("norm", norm)) if v is not None}
        return plan.finish(residual, **extra)

    # -- the halves apart (the decoder) --------------------------------------------------------
    def make_resident(self) -> bool:
        """Where the pool holds every expert: load them all and fill the slot tables for good."""
        if not self.resident and self.provider.can_hold_all() and self.provider.make_resident():
            for layer, table in self.tables.items():
                table.copy_(self.provider.resident_table(layer))
            self.resident = True
        return self.resident

    def start_device_map(self) -> None:
        """Device-driven streaming (moestream.experts.device_map): each layer call finds or copies its
        experts on the device; raises DeviceMapUnavailable where it cannot run. The CPU share, where
        asked for, starts with it."""
        if self.device_map is None:
            dm = self.provider.start_device_map()
            for layer in self.tables:
                self.tables[layer] = dm.layer_table(layer)
            self.device_map = dm
            request = self.share_request
            if request is not None:
                try:
                    self.cpu_share = CpuShare(self.provider, dm, share=request.share, hidden=request.hidden,
                                              max_tokens=request.max_tokens, dtype=request.dtype,
                                              threads=request.threads)
                except ShareUnavailable as exc:
                    log.info("no CPU share: %s", exc)

    @property
    def device_driven(self) -> bool:
        """Whether a layer call needs no host half: every expert resident, or the device map drives."""
        return self.resident or self.device_map is not None

    def load(self, layer: int, ids_host: list[int]) -> bool:
        """Host half for the decoder: pin the distinct `ids_host`, write their slots into the layer's
        table. False (nothing pinned) beyond the batch limit: the caller then runs `__call__`."""
        experts = sorted(set(ids_host))
        if self.parallel is not None:
            experts = self.parallel.mine(layer, experts)
        if len(experts) > self.provider.batch_limit(layer):
            return False
        self.provider.fetch(layer, experts, views=False)
        slots = self.provider.slots_of(layer, experts)
        # the previous step's copy from this host table was queued before the ids just read, so it is done
        host = self._host_tables[layer]
        host.fill_(-1)
        host[experts] = torch.tensor(slots, dtype=torch.int32)
        self.tables[layer].copy_(host, non_blocking=True)
        return True

    def release(self, layer: int) -> None:
        if not self.device_driven:
            self.provider.release(layer)

    def count_resident_step(self, routed: list[tuple[int, torch.Tensor]]) -> None:
        """count_resident for every MoE layer [(layer, ids)] of a step that ran without the host half."""
        self.provider.count_resident_many(routed)
        if self.on_route is not None:
            for layer, ids in routed:
                self.on_route(layer, ids)

    def compute(self, layer: int, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *,
                residual: torch.Tensor | None = None, out: torch.Tensor | None = None,
                per_pair: bool = True, split_x: torch.Tensor | None = None,
                norm: tuple | None = None) -> torch.Tensor:
        """Device half: the routed experts from the layer's slot table (set by `load`, resident, or
        updated here by the device map, with the CPU's share where it runs). Triton only: split_x, x
        in the gemv kernels' input order; norm (weight, eps, normed), the next layer's input norm
        written into normed by the last kernel (MoEPlan.finish)."""
        if self.device_map is not None:
            share = self.cpu_share
            if share is not None and share.takes(x, ids) and not share.refused.get(layer):
                return share.compute(self, layer, x, ids, weights, residual=residual, out=out, split_x=split_x,
                                     norm=norm)
            self.device_map.ensure(layer, ids)
        plan = self.plan(layer, x, ids, weights, per_pair=per_pair, split_x=split_x)
        plan.run_table(self.provider.slot_pool(layer), self.tables[layer])
        return self.finish_plan(plan, residual, out, norm)

    def close(self) -> None:
        """Stop the CPU share's worker (the provider is its owner's to close)."""
        if self.cpu_share is not None:
            self.cpu_share.close()
