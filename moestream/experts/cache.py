"""The expert slot cache: one pool of slots on the compute device, shared by all layers.

`fetch` pins the experts a layer's router chose; misses get a slot from the directory (free, or a
policy's victim among unpinned, ready slots), filled from the host tier or the record source;
`prefetch` fills slots early. A layer computes only after its slots are filled: what moves never
changes the answer. On CUDA, records go disk -> pinned buffer -> slot by an async copy on a stream of
its own, and a victim slot is overwritten only after the compute that read it."""
from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Sequence

import torch
from tqdm import tqdm

from moestream.errors import ExpertReadError
from moestream.experts.buffers import aligned_buffer, pin_if_cuda
from moestream.experts.directory import CacheFullError, SlotDirectory
from moestream.experts.host_tier import HostTier
from moestream.format.reader import PackedModel
from moestream.format.records import decode_record
from moestream.quant.affine import QuantSpec


@dataclass
class CacheStats:
    """The cache's figures (its lookups', the device map's and the resident tables' counts). Plain
    counters: the cache holds its lock where reader threads add to them."""

    hits: int = 0
    misses: int = 0
    bytes_read_disk: int = 0
    bytes_read_host: int = 0
    read_wait_s: float = 0.0
    prefetch_issued: int = 0
    prefetch_used: int = 0
    evictions: int = 0
    layer_hits: dict = field(default_factory=dict)
    layer_misses: dict = field(default_factory=dict)

    def count(self, layer: int, *, hit: bool, n: int = 1) -> None:
        """Book n hits (or misses) of `layer`."""
        table = self.layer_hits if hit else self.layer_misses
        table[layer] = table.get(layer, 0) + n
        if hit:
            self.hits += n
        else:
            self.misses += n

    def add_device_counts(self, counts: dict[int, tuple[int, int]], record_bytes: dict[int, int]) -> None:
        """Book the device-driven path's {layer: (hits, misses)}; each miss copied one record from the host tier."""
        for layer, (hits, misses) in counts.items():
            self.count(layer, hit=True, n=hits)
            self.count(layer, hit=False, n=misses)
            self.bytes_read_host += misses * record_bytes[layer]

    def hit_rate_per_layer(self, layers: list[int]) -> dict[str, float]:
        """{layer: hit rate} of the layers that were looked up at all."""
        rates = {}
        for layer in layers:
            hits, misses = self.layer_hits.get(layer, 0), self.layer_misses.get(layer, 0)
            if hits + misses:
                rates[str(layer)] = round(hits / (hits + misses), 4)
        return rates


class ExpertCache:
    """What RoutedExperts computes from: a fixed slot pool (see the module doc)."""

    def __init__(self, packed: PackedModel, device: torch.device, *, slots: int, source, policy: str = "clock",
                 host_slots: int = 0, host_policy: str = "clock", staging_buffers: int = 8,
                 device_policy: str = "cycle", timeline):
        """timeline: where loads, waits on reads, reads and copies are recorded (an object with
        `complete(name, start_s, end_s, **args)` and `instant(name, **args)`: moestream.engine.timeline)."""
        self.packed, self.device, self.source = packed, torch.device(device), source
        self.timeline = timeline
        self.entries = {e.layer: e for e in packed.manifest.expert_layers}
        self.moe_layers = sorted(self.entries)
        self._index = {layer: i for i, layer in enumerate(self.moe_layers)}  # directory keys use dense layer indices
        self.slot_bytes = max(e.record_size for e in self.entries.values())
        self.total_experts = sum(e.num_experts for e in self.entries.values())
        self.num_slots = slots
        self._quant = {l: {p: QuantSpec.from_json(s) for p, s in e.quant.items()} for l, e in self.entries.items()}
        self.directory = SlotDirectory(slots, policy=policy)
        self.cuda = self.device.type == "cuda"
        if self.cuda:
            self.pool = torch.empty((slots, self.slot_bytes), dtype=torch.uint8, device=self.device)
            self.copy_stream = torch.cuda.Stream(self.device)
            # early copies on their own stream, so a layer's demand copies never queue behind guesses
            self.early_stream = torch.cuda.Stream(self.device)
            # the stream compute runs on (the default one), kept: torch.cuda.current_stream() costs ~25 us
            # of CPU per call on a GPU machine, and a streamed layer would ask several times
            self.compute_stream = torch.cuda.current_stream(self.device)
            self.staging: queue.Queue = queue.Queue()
            for _ in range(staging_buffers):
                self.staging.put(pin_if_cuda(aligned_buffer(self.slot_bytes)))
            self.ready_events: dict = {}
        else:  # page-aligned RAM, so direct reads land in the slot itself
            self.pool = aligned_buffer(slots * self.slot_bytes).view(slots, self.slot_bytes)
        self._lock = threading.Lock()  # guards the host tier's directory and the stats reader threads add to
        self.host = HostTier(host_slots, self.slot_bytes, policy=host_policy, pin=self.cuda,
                             lock=self._lock) if host_slots else None
        self.pending: dict = {}  # device key -> Future that completes when the slot holds the record
        self._victim_events: dict = {}  # slot -> event after the last compute that may read it (CUDA)
        self._pinned: dict[int, list] = {}
        self._prefetched: set = set()  # early reads not yet used (counted when a fetch finds them)
        self._prefetch_loading: set = set()  # those of them still loading
        self._deferred: list = []  # (copy event, callback): host tier slots to unpin once their copy is done
        self.resident_tables: dict[int, torch.Tensor] = {}  # layer -> int32 [E] slots, once all are resident
        # per MoE layer, counted by resident layers: made once (`_hit_counter`) and zeroed when read,
        # never replaced, so no queued or captured work can add into memory the allocator gave back
        self._device_hits: torch.Tensor | None = None
        self._hit_rows: dict[tuple, torch.Tensor] = {}  # count_resident_many's layer rows, per set of layers
        self.device_map = None  # a DeviceMap once device-driven streaming started (start_device_map)
        self.device_policy = device_policy  # its victim rule (moestream.experts.device_map)
        self.stats_ = CacheStats()

    # -- what RoutedExperts asks for -------------------------------------------------
    def quant(self, layer: int) -> dict[str, QuantSpec]:
        return self._quant[layer]

    def fetch(self, layer: int, experts: Sequence[int], *, views: bool = True) -> dict[int, dict[str, torch.Tensor]]:
        """Pin the experts' slots, loading misses; returns record views (none with views=False, for
        kernels that index the pool through `slots_of`)."""
        entry, li = self.entries[layer], self._index[layer]
        pinned, waits = [], []
        st = self.stats_
        started, missed = time.perf_counter(), st.misses
        self._run_deferred()
        self._reap_prefetches()
        try:
            for e in experts:
                key = (li, e)
                hit = self.directory.lookup(key) is not None
                st.count(layer, hit=hit)
                if not hit:
                    self._reserve(key)
                self.directory.pin(key)
                pinned.append(key)
                if not hit:
                    self._start_load(key)
                    waits.append(key)
                    continue
                self.directory.touch(key)
                if key in self._prefetched:
                    self._prefetched.discard(key)
                    st.prefetch_used += 1
                if key in self.pending:
                    waits.append(key)
            t0 = time.perf_counter()
            error = None
            for key in waits:  # wait for all, even after a failure, so no read lands in a freed slot later
                try:
                    self._finish(key)
                except ExpertReadError as exc:
                    error = error or exc
            if waits:
                st.read_wait_s += time.perf_counter() - t0
                self.timeline.complete("wait_reads", t0, time.perf_counter(), layer=layer, reads=len(waits))
            if error is not None:
                raise error
        except BaseException:
            for key in pinned:
                if self.directory.lookup(key) is not None:
                    self.directory.unpin(key)
            raise
        self._pinned.setdefault(layer, []).extend(pinned)
        if self.cuda:
            current = self.compute_stream
            for key in pinned:
                event = self.ready_events.pop(key, None)
                if event is not None:
                    current.wait_event(event)
        self.timeline.complete("load", started, time.perf_counter(), layer=layer, experts=len(experts),
                          misses=st.misses - missed)
        if not views:
            return {}
        return {e: decode_record(entry.fields, self.pool[self.directory.lookup((li, e))][: entry.record_size])
                for e in experts}

    def slot_pool(self, layer: int) -> torch.Tensor:
        """uint8 [slots, slot_bytes]: one pool shared by every layer."""
        return self.pool

    def slots_of(self, layer: int, experts: Sequence[int]) -> list[int]:
        """Slot indices in `self.pool` of experts fetched (and still pinned) for `layer`."""
        li = self._index[layer]
        return [self.directory.lookup((li, e)) for e in experts]

    def record_fields(self, layer: int):
        """The byte layout of `layer`'s records inside a slot (offsets, dtypes, shapes)."""
        return self.entries[layer].fields

    def batch_limit(self, layer: int) -> int:
        return self.num_slots

    def release(self, layer: int) -> None:
        for key in self._pinned.pop(layer, []):
            self.directory.unpin(key)

    def prefetch(self, layer: int, experts: Sequence[int]) -> int:
        """Start early reads for experts not yet in a slot; never blocks, never pins. Returns reads issued."""
        li, issued = self._index[layer], 0
        for e in experts:
            key = (li, e)
            if self.directory.lookup(key) is not None:
                continue
            try:
                self._reserve(key, wait=False)
            except CacheFullError:
                break
            self._start_load(key, early=True)
            self._prefetched.add(key)
            self._prefetch_loading.add(key)
            issued += 1
        self.stats_.prefetch_issued += issued
        return issued

    def fill_host_tier(self) -> int:
        """Read every record the host tier has room for and lacks, in parallel, straight into its
        slots; returns the records read."""
        if self.host is None:
            return 0
        todo = [(e.layer, x) for e in self.entries.values() for x in range(e.num_experts)
                if self.host.directory.lookup((e.layer, x)) is None][:self.host.slots - self.host.directory.occupied()]
        reads = []
        for layer, expert in todo:
            buffer = self.host.reserve((layer, expert))
            size = self.entries[layer].record_size
            reads.append(((layer, expert), self.source.submit(layer, expert, buffer[:size]), size))
        for hkey, read, size in tqdm(reads, desc="filling the host tier", unit="record", disable=None, leave=False):
            read.result()
            self._add(bytes_read_disk=size)
            self.host.mark_ready(hkey)
        return len(reads)

    # -- everything resident ----------------------------------------------------------
    def can_hold_all(self) -> bool:
        """Whether the pool has a slot for every expert of every layer."""
        return self.num_slots >= self.total_experts

    def make_resident(self) -> bool:
        """Where the pool holds every expert: load them all, pinned for good, with a device slot table
        per layer (`resident_table`). Loading counts as reads, not as hits or misses."""
        if self.resident_tables:
            return True
        if not self.can_hold_all():
            return False
        st = self.stats_
        counts = (st.hits, st.misses, dict(st.layer_hits), dict(st.layer_misses))
        tables = {}
        for layer in tqdm(self.moe_layers, desc="loading experts", unit="layer", disable=None, leave=False):
            experts = list(range(self.entries[layer].num_experts))
            self.fetch(layer, experts, views=False)
            self._pinned.pop(layer, None)  # these pins are never released
            tables[layer] = torch.tensor(self.slots_of(layer, experts), dtype=torch.int32).to(self.device)
        st.hits, st.misses, st.layer_hits, st.layer_misses = counts
        self.resident_tables = tables
        self._hit_counter()  # now, outside any graph capture
        return True

    def resident_table(self, layer: int) -> torch.Tensor | None:
        """int32 [E] device tensor of every expert's slot, once `make_resident` succeeded; else None."""
        return self.resident_tables.get(layer)

    def count_resident(self, layer: int, ids: torch.Tensor) -> None:
        """Book as hits the experts a layer ran from its resident table: as many as a lookup would
        have made (the distinct ids), counted on the device so that no host sync is needed."""
        if ids.shape[0] == 1:  # one token's top-k ids are distinct
            self.stats_.count(layer, hit=True, n=ids.numel())
            return
        hits = self._hit_counter()
        flat = ids.reshape(-1).to(torch.int64)
        seen = torch.zeros(self.entries[layer].num_experts, dtype=torch.int64, device=self.device)
        seen.scatter_(0, flat, 1)  # torch.bincount would sync with the host on CUDA
        hits[self._index[layer]] += seen.sum()

    def count_resident_many(self, routed: list[tuple[int, torch.Tensor]]) -> None:
        """count_resident for every MoE layer of a step at once [(layer, ids [T, A])]: a handful of
        kernels for the whole step rather than a handful per layer (a step of many rows)."""
        if len(routed) < 2 or routed[0][1].shape[0] == 1:
            for layer, ids in routed:
                self.count_resident(layer, ids)
            return
        hits = self._hit_counter()
        flat = torch.stack([ids.reshape(-1) for _, ids in routed]).to(torch.int64)  # [L, T*A]
        experts = max(self.entries[layer].num_experts for layer, _ in routed)
        seen = torch.zeros((len(routed), experts), dtype=torch.int64, device=self.device).scatter_(1, flat, 1)
        key = tuple(layer for layer, _ in routed)
        rows = self._hit_rows.get(key)
        if rows is None:
            rows = self._hit_rows[key] = torch.tensor([self._index[layer] for layer in key], device=self.device)
        hits.index_add_(0, rows, seen.sum(dim=1))

    def _hit_counter(self) -> torch.Tensor:
        """The device counters of resident hits (int64 per MoE layer), made by make_resident. Never
        counted inside a graph's capture: every replay would add into them."""
        if self.cuda and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("resident hits are counted outside CUDA graph captures (book them after the replay)")
        if self._device_hits is None:
            self._device_hits = torch.zeros(len(self.moe_layers), dtype=torch.int64, device=self.device)
        return self._device_hits

    # -- device-driven streaming ----------------------------------------------------------
    def start_device_map(self):
        """Hand the slot pool to a DeviceMap, given a host tier holding every record (filled here) that
        the GPU can read; else DeviceMapUnavailable says what lacks."""
        from moestream.experts.device_map import DeviceMap, DeviceMapUnavailable
        from moestream.experts.uva import device_view

        if self.device_map is not None:
            return self.device_map
        if self.host is None or self.host.slots < self.total_experts:
            have = self.host.slots if self.host is not None else 0
            raise DeviceMapUnavailable(f"the host tier holds {have} of the {self.total_experts} expert records "
                                       "(device-driven streaming needs them all: --host-cache-size all)")
        self.fill_host_tier()
        self._run_deferred(wait=True)
        for key in list(self.pending):
            self._finish(key)
        host = device_view(self.host.pool) if self.cuda else self.host.pool
        if host is None:
            raise DeviceMapUnavailable("this GPU cannot read the pinned host tier at its address (no unified addressing)")
        self.device_map = DeviceMap(self.pool, host, self.host.directory.keys(),
                                    {l: e.num_experts for l, e in self.entries.items()},
                                    {l: e.record_size for l, e in self.entries.items()}, policy=self.device_policy)
        return self.device_map  # it starts empty: what the host path left in the slots is not reused

    def _collect_device_hits(self) -> None:
        if self.device_map is not None:
            self.stats_.add_device_counts(self.device_map.counts(), self.device_map.record_bytes)
            self.device_map.reset_counts()
        if self._device_hits is not None:
            counts = self._device_hits.tolist()
            with torch.inference_mode():  # the counter is made inside the engine's inference mode
                self._device_hits.zero_()  # in place: work queued earlier may hold its address
            for layer, n in zip(self.moe_layers, counts):
                self.stats_.count(layer, hit=True, n=n)

    # -- loading ------------------------------------------------------------------
    def _reserve(self, key, *, wait: bool = True) -> int:
        try:
            res = self.directory.reserve(key)
        except CacheFullError:
            if not wait or not self.pending:
                raise
            self._settle(self.pending)  # early reads hold slots: let them land, then retry
            res = self.directory.reserve(key)
        if res.evicted is not None:
            self.stats_.evictions += 1
            self.pending.pop(res.evicted, None)
            self._prefetched.discard(res.evicted)
            if self.cuda:
                self.ready_events.pop(res.evicted, None)
        if self.cuda:  # the copy into this slot must wait for compute that still reads its old record
            event = self._victim_events[res.slot] = torch.cuda.Event()
            event.record(self.compute_stream)
        return res.slot

    def _start_load(self, key, *, early: bool = False) -> None:
        li, expert = key
        layer = self.moe_layers[li]
        slot = self.directory.lookup(key)
        size = self.entries[layer].record_size
        done: Future = Future()
        self.pending[key] = done
        host = self._host_record(layer, expert, size)
        if host is not None:  # in host RAM already: only a copy
            view, after = host
            self._add(bytes_read_host=size)
            self._copy_into_slot(key, slot, view, size, done, after=after, defer=True, early=early)
            return
        self.timeline.instant("read", layer=layer, expert=expert, early=early)
        if self.cuda:
            staging = self.staging.get()
            read = self.source.submit(layer, expert, staging[:size])
            read.add_done_callback(lambda f: self._after_read(f, key, slot, staging[:size], size, done,
                                                              after=lambda: self.staging.put(staging), early=early))
        else:
            target = self.pool[slot][:size]
            if not early and self.source.resident(layer, [expert])[0]:
                # in the page cache: a copy on this thread, which waits for it anyway (a hand-off to a
                # reader thread costs more than the copy and its crc32 on busy cores)
                read = Future()
                try:
                    self.source.read(layer, expert, target)
                    read.set_result(None)
                except BaseException as exc:  # noqa: BLE001 - handed to the waiter by _after_read
                    read.set_exception(exc)
                self._after_read(read, key, slot, target, size, done, after=None)
                return
            read = self.source.submit(layer, expert, target)
            read.add_done_callback(lambda f: self._after_read(f, key, slot, target, size, done, after=None))

    def _host_record(self, layer: int, expert: int, size: int):
        """(view, after-copy callback) of the record if host RAM holds it: a host tier slot (pinned
        while it is copied) or a page-cache mapping whose pages are all resident. Else None."""
        if self.host is not None:
            view = self.host.pin_ready((layer, expert), size)
            if view is not None:
                return view, lambda: self.host.unpin((layer, expert))
        view = self.source.view(layer, expert)
        if view is not None and all(self.source.resident(layer, [expert])):
            return view, None
        return None

    def _reap_prefetches(self) -> None:
        """Mark early reads that have landed as ready, so that a guess nobody used can be evicted."""
        landed = [k for k in self._prefetch_loading if k not in self.pending or self.pending[k].done()]
        self._prefetch_loading.difference_update(landed)  # only loading ones are looked at: this runs at every fetch
        self._settle(landed)

    def _settle(self, keys) -> None:
        """Wait for these loads; a failed one's slot is freed (a later fetch reads the expert again)."""
        for key in list(keys):
            try:
                self._finish(key)
            except ExpertReadError:
                pass

    def _run_deferred(self, *, wait: bool = False) -> None:
        """Run the callbacks of finished host->device copies (all of them, waiting, with wait)."""
        keep = []
        for event, after in self._deferred:
            if wait or event.query():
                event.synchronize()
                after()
            else:
                keep.append((event, after))
        self._deferred = keep

    def _after_read(self, read: Future, key, slot: int, data: torch.Tensor, size: int, done: Future, after, *,
                    early: bool = False) -> None:
        """Runs on a reader thread when a disk read finishes."""
        layer, expert = self.moe_layers[key[0]], key[1]
        try:
            read.result()
            self.timeline.instant("read_done", layer=layer, expert=expert)
            self._add(bytes_read_disk=size)
            if self.host is not None:
                self.host.store((layer, expert), data, size)
            self._copy_into_slot(key, slot, data, size, done, after=after, early=early)
        except BaseException as exc:  # hand the failure to whoever waits on this slot
            if after is not None:
                after()
            if not done.done():
                done.set_exception(exc if isinstance(exc, ExpertReadError) else
                                   ExpertReadError(f"reading layer {layer} expert {expert}: {exc}"))

    def _copy_into_slot(self, key, slot: int, data: torch.Tensor, size: int, done: Future, after, *,
                        defer: bool = False, early: bool = False) -> None:
        """Copy a host record into its device slot; `after` runs once the source is free again: after
        waiting, or (defer, main thread only) when a later call finds the copy done, so that copies
        queue back to back on the link."""
        if self.cuda or data.data_ptr() != self.pool[slot].data_ptr():  # a CPU read lands in its slot: no copy
            self.timeline.instant("copy", layer=self.moe_layers[key[0]], expert=key[1], early=early)
        if self.cuda:
            stream = self.early_stream if early else self.copy_stream
            with torch.cuda.stream(stream):
                victim = self._victim_events.pop(slot, None)
                if victim is not None:
                    stream.wait_event(victim)
                self.pool[slot][:size].copy_(data, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            self.ready_events[key] = event
            if after is not None and defer:
                self._deferred.append((event, after))
                after = None
            elif after is not None:
                event.synchronize()
        elif data.data_ptr() != self.pool[slot].data_ptr():
            self.pool[slot][:size].copy_(data)
        if after is not None:
            after()
        done.set_result(None)

    def _finish(self, key) -> None:
        """Wait for a slot's load; mark it ready, or free it and raise on failure."""
        fut = self.pending.pop(key, None)
        if fut is None:
            return
        try:
            fut.result()
        except ExpertReadError:
            self.directory.abort(key)
            self._prefetched.discard(key)
            raise
        self.directory.mark_ready(key)

    def _add(self, **amounts) -> None:
        with self._lock:
            for name, value in amounts.items():
                setattr(self.stats_, name, getattr(self.stats_, name) + value)

    # -- reporting ----------------------------------------------------------------
    def stats(self) -> dict:
        self._collect_device_hits()
        st = self.stats_
        lookups = st.hits + st.misses
        source = self.source.stats()
        read_s = source.get("read_s", 0.0)
        return {
            "source": getattr(self.source, "name", "?"), "verify": bool(getattr(self.source, "check_records", False)),
            "policy": self.directory.policy_name,
            "streaming": "resident" if self.resident_tables else "device" if self.device_map is not None else "host",
            **({"device_policy": self.device_map.policy} if self.device_map else {}),
            "slots": self.num_slots, "slot_bytes": self.num_slots * self.slot_bytes,
            "total_experts": self.total_experts, "host_slots": self.host.slots if self.host else 0,
            "hits": st.hits, "misses": st.misses, "hit_rate": round(st.hits / lookups, 6) if lookups else 1.0,
            "hit_rate_per_layer": st.hit_rate_per_layer(self.moe_layers), "evictions": st.evictions,
            "bytes_read_disk": st.bytes_read_disk, "bytes_read_host": st.bytes_read_host,
            "read_wait_s": round(st.read_wait_s, 6),
            "disk_read_gb_s": round(source.get("bytes_read", 0) / read_s / 1e9, 3) if read_s > 0 else None,
            "prefetch_issued": st.prefetch_issued, "prefetch_used": st.prefetch_used,
        }

    def close(self) -> None:
        self._run_deferred(wait=True)
        self._settle(self.pending)
        self.source.close()
