"""How routed experts reach the compute: the choices an Engine makes when it loads and at its first
step, kept apart from the engine's running of the model.

- expert parallelism: which rank owns which experts (`expert_parallel`), and every rank's
  figures for a run (`parallel_stats`);
- the lookahead's fitted corrections (`load_guess_maps`, from moestream fit-lookahead);
- the CPU's share of the misses (`share_with_cpu`, `prepare_cpu_share`: --cpu-experts);
- device- or host-driven streaming (`start_streaming`: --streaming)."""
from __future__ import annotations

import logging
import time
from typing import Any

import torch

from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel

log = logging.getLogger(__name__)


def expert_parallel(packed: PackedModel, options: EngineOptions):
    """The ExpertParallel of this rank (group and placement), or None for one process."""
    group = options.expert_parallel
    if group is None or group.world_size <= 1:
        return None
    from moestream.layers.expert_parallel import ExpertParallel, ExpertPlacement

    counts = {e.layer: e.num_experts for e in packed.manifest.expert_layers}
    if options.expert_placement:
        placement = ExpertPlacement.from_trace(options.expert_placement, counts, group.world_size)
    else:
        placement = ExpertPlacement.modulo(counts, group.world_size)
    log.info("rank %d of %d: %d experts (%s placement)", group.rank, group.world_size,
             placement.count(group.rank), placement.source)
    return ExpertParallel(group, placement)


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
    from moestream.experts.guess_maps import GuessMaps, manifest_digest, maps_path
    from moestream.layers.moe import MoEBlock

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


def share_with_cpu(experts, options: EngineOptions, *, parallel, dtype: torch.dtype) -> None:
    """--cpu-experts: the CPU computes a share of each streamed layer's misses from host RAM,
    on a worker with the compute threads (--threads). Its weights are repacked before the first
    step (`prepare_cpu_share`)."""
    from moestream.layers.cpu_share import parse_share

    try:
        share = parse_share(options.cpu_experts)
    except ValueError as exc:
        raise MoestreamError(f"cpu_experts: {exc}") from None
    if share == "off":
        return
    if parallel is not None:
        raise MoestreamError("--cpu-experts does not run with expert parallelism (--devices)")
    if not options.cpu_experts_timeout > 0:
        raise MoestreamError(f"cpu_experts_timeout must be more than 0 seconds, not {options.cpu_experts_timeout}")
    experts.share_with_cpu(share, dtype=dtype, timeout_s=options.cpu_experts_timeout, threads=options.threads)


def prepare_cpu_share(provider, experts, *, repack: bool = True) -> None:
    """Before the first streamed step with a CPU share: fill the host tier (the records it lacks)
    and repack every record of it the CPU kernels take, once, so that a step never repacks
    (repack False: the native worker computes from the records as they are)."""
    if provider.host is None:
        log.warning("--cpu-experts: there is no host tier (--host-cache-size), so the CPU has no "
                    "repacked experts to compute")
        return
    t0 = time.perf_counter()
    read = provider.fill_host_tier()
    if read:
        log.info("read %d records into the host tier for the CPU share (%.1f s)", read, time.perf_counter() - t0)
    if repack:
        experts.cpu.repack_host_tier(provider.host_records())
    else:
        log.info("the CPU share's native worker reads the host tier's records as they are: nothing repacked")


def start_streaming(engine: Any) -> None:  # an Engine (moestream.engine.engine imports this module)
    """Device-driven streaming where the option allows and it can run (else the host path);
    `--streaming device` where it cannot is an error naming why."""
    from moestream.experts.device_map import DeviceMapUnavailable

    experts, options, provider = engine.experts, engine.options, engine.provider
    if experts.cpu is not None:
        from moestream.layers.native_worker import unavailable

        # `--streaming device` runs the device path's share, whose native worker needs no repacked copies
        prepare_cpu_share(provider, experts, repack=options.streaming != "device" or unavailable(experts.cpu) is not None)
    mode = options.streaming
    if mode == "host":
        return
    reason = None
    if engine.parallel is not None:
        reason = "expert parallelism computes experts on several ranks"
    elif mode == "auto" and options.cpu_experts != "off":
        # the device path's CPU share (a mailbox the step's graph waits on) has not been timed on a
        # GPU yet: `--streaming device` asks for it
        reason = "a CPU share runs on the host path unless --streaming device asks for the device path's"
    elif mode == "auto" and engine.device.type != "cuda":
        reason = "on the CPU the host drives"
    elif mode == "auto" and not all(experts.uses_triton(layer, engine.dtype) for layer in experts.num_experts):
        reason = "some layers' experts run on the torch reference, which reads slots on the host"
    elif mode == "auto" and engine.plan.host_slots < provider.total_experts:
        reason = "the host tier does not hold every expert (--host-cache-size all)"
    if reason is None:
        t0 = time.perf_counter()
        try:
            experts.start_device_map()
            experts.device_map.kernel = options.slot_map == "triton"
            if experts.cpu is not None:  # the CPU's share through a mailbox, inside the graphs
                experts.share_on_device(hidden=engine.args.hidden_size, dtype=engine.dtype, max_tokens=16,
                                        timeout_s=options.cpu_experts_timeout)
            elif options.device_lookahead and options.prefetch != "none":
                engine.decoder.start_device_lookahead(2 if options.prefetch == "two-layers" else 1)
            log.info("device-driven streaming: %d slots, the host tier holds all %d experts (%.1f s)",
                     engine.plan.slots, provider.total_experts, time.perf_counter() - t0)
            return
        except DeviceMapUnavailable as exc:
            reason = str(exc)
    if mode == "device":
        raise MoestreamError(f"--streaming device cannot run: {reason}")
    log.info("host-driven streaming: %s", reason)
