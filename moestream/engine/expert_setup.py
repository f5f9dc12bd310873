"""How routed experts reach the compute, decided when an Engine loads and at its first step: expert
parallelism, the lookahead's fitted maps, the CPU share, device- or host-driven streaming."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from moestream.cpu_share.share import ShareRequest, parse_share
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.experts.device_map import DeviceMapUnavailable
from moestream.experts.guess_maps import GuessMaps, manifest_digest, maps_path
from moestream.experts.trace import RoutingTrace
from moestream.format.reader import PackedModel
from moestream.layers.expert_parallel import ExpertParallel, ExpertPlacement
from moestream.layers.moe import MoEBlock

log = logging.getLogger(__name__)


def expert_parallel(packed: PackedModel, options: EngineOptions):
    """The ExpertParallel of this rank (group and placement), or None for one process."""
    group = options.expert_parallel
    if group is None or group.world_size <= 1:
        return None
    counts = {e.layer: e.num_experts for e in packed.manifest.expert_layers}
    if options.expert_placement:
        placement = placement_from_trace(options.expert_placement, counts, group.world_size)
    else:
        placement = ExpertPlacement.modulo(counts, group.world_size)
    log.info("rank %d of %d: %d experts (%s placement)", group.rank, group.world_size,
             placement.count(group.rank), placement.source)
    return ExpertParallel(group, placement)


def placement_from_trace(path: str, counts: dict[int, int], world_size: int):
    """The placement balanced by a routing trace's expert counts (--expert-placement)."""
    try:
        trace = RoutingTrace.load(path)
    except (OSError, ValueError, KeyError) as exc:
        raise MoestreamError(f"expert placement: cannot read the routing trace {path}: {exc}") from None
    return ExpertPlacement.from_routes(trace.layer, trace.experts, counts, world_size, path=str(path))


def parallel_stats(parallel, before: dict, after: dict) -> dict | None:
    """Every rank's expert-cache figures for a run (from its stats before and after), gathered
    from all ranks (a collective: every rank calls it at the same point). None for one process."""
    if parallel is None:
        return None
    group = parallel.group
    hits, misses = (after.get(k, 0) - before.get(k, 0) for k in ("hits", "misses"))
    mine = {"rank": group.rank, "experts_owned": parallel.placement.count(group.rank),
            "hit_rate": round(hits / (hits + misses), 6) if hits + misses else 1.0, "hits": hits,
            "misses": misses,
            **{k: after.get(k, 0) - before.get(k, 0) for k in ("bytes_read_disk", "bytes_read_host")},
            "read_wait_s": round(after.get("read_wait_s", 0.0) - before.get("read_wait_s", 0.0), 6),
            "collective_s": round(after.get("collective_s", 0.0) - before.get("collective_s", 0.0), 6),
            "exchanges": after.get("exchanges", 0) - before.get("exchanges", 0)}
    return {"world_size": group.world_size, "placement": parallel.placement.source,
            "ranks": group.all_gather_object(mine)}


def load_guess_maps(packed: PackedModel, options: EngineOptions, model, *, hidden_size: int,
                    device: torch.device):
    """The lookahead's fitted corrections (moestream fit-lookahead) on the device, or None."""
    path = maps_path(packed.directory, options.lookahead_maps)
    if path is None:
        return None
    if not path.is_file():
        raise MoestreamError(f"lookahead maps {path}: no such file")
    try:
        maps = GuessMaps.load(path)
        maps.check([layer.ffn for layer in model.layers if isinstance(layer.ffn, MoEBlock)], hidden_size)
    except ValueError as exc:
        raise MoestreamError(str(exc)) from None
    fitted_for = maps.meta.get("model_manifest_sha256")
    if fitted_for is not None and fitted_for != manifest_digest(packed.directory):
        raise MoestreamError(f"lookahead maps {path} were fitted for another model (its moestream.json differs)")
    log.info("lookahead maps: %s (%d maps, %d bytes)", path, len(maps.maps), maps.nbytes)
    return maps.to(device)


def share_request(options: EngineOptions, *, parallel, hidden: int, dtype: torch.dtype):
    """The CPU share RoutedExperts starts with device-driven streaming (--cpu-experts), or None (off,
    or `auto` under expert parallelism, where a share asked for by number is an error)."""
    try:
        share = parse_share(options.cpu_experts)
    except ValueError as exc:
        raise MoestreamError(f"cpu_experts: {exc}") from None
    if share == "off":
        return None
    if parallel is not None:
        if share != "auto":
            raise MoestreamError("--cpu-experts does not run with expert parallelism (--devices)")
        return None
    return ShareRequest(share, threads=options.threads or torch.get_num_threads(), hidden=hidden, dtype=dtype)


def start_streaming(engine: Any) -> None:  # an Engine (moestream.engine.engine imports this module)
    """Device-driven streaming where it can run (else the host path); the engine's streaming="device"
    where it cannot is an error naming why."""
    experts, provider, mode = engine.experts, engine.provider, engine.streaming_mode
    reason = "asked for the host path" if mode == "host" else None
    if reason is None and engine.parallel is not None:
        reason = "expert parallelism computes experts on several ranks"
    elif reason is None and mode == "auto" and engine.device.type != "cuda":
        reason = "on the CPU the host drives"
    elif reason is None and mode == "auto" and not all(experts.uses_triton(layer, engine.dtype)
                                                       for layer in experts.num_experts):
        reason = "some layers' experts run on the torch reference, which reads slots on the host"
    elif reason is None and mode == "auto" and engine.plan.host_slots < provider.total_experts:
        reason = "the host tier does not hold every expert (--host-cache-size all)"
    if reason is None:
        t0 = time.perf_counter()
        try:
            experts.start_device_map()
            log.info("device-driven streaming: %d slots, the host tier holds all %d experts (%.1f s)",
                     engine.plan.slots, provider.total_experts, time.perf_counter() - t0)
            return
        except DeviceMapUnavailable as exc:
            reason = str(exc)
    if mode == "device":
        raise MoestreamError(f"device-driven streaming cannot run: {reason}")
    log.info("host-driven streaming: %s", reason)
    request = experts.share_request
    if request is not None and request.share != "auto":
        log.warning("--cpu-experts %s: no CPU share (it runs with device-driven streaming only)", request.share)
