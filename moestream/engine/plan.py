"""Deciding a run's shape before loading anything: device, dtype, context, slots, host tier, ledger."""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace

import psutil
import torch

from moestream.engine.budget import Ledger, plan_ledger, resident_bytes, slots_within, unpacked_expert_bytes
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.experts.sizing import parse_bytes, slots_for
from moestream.format.integrity import check_resident_files
from moestream.format.reader import PackedModel
from moestream.kv.pool import BLOCK_SIZE, full_blocks
from moestream.layers.native_experts import takes_every_layer
from moestream.models.registry import family_module

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_DEFAULT_CONTEXT = 32768
# under --memory-budget without --max-context: a KV cache for 8k tokens leaves the rest to experts
BUDGET_DEFAULT_CONTEXT = 8192
# kept unpacked experts: on the CPU, at most this share of the memory budget (or of free RAM)
UNPACKED_SHARE = 0.25
# under --memory-budget the prefill chunk is halved until its workspace takes at most this share
BUDGET_WORKSPACE_SHARE = 0.08
MIN_BUDGET_CHUNK = 128
STAGING_BUFFERS = 8  # pinned buffers for disk -> GPU on CUDA


@dataclass
class RunPlan:
    device: torch.device
    dtype: torch.dtype
    max_context: int
    slots: int
    host_slots: int
    slot_bytes: int
    total_experts: int
    min_slots: int
    staging: int
    ledger: Ledger
    prefill_chunk: int = 2048  # prompt tokens per prefill pass (a memory budget may lower it)
    unpacked: int = 0  # experts whose dequantized copies the CPU keeps (moestream.experts.unpacked)
    unpacked_bytes: int = 0  # one such copy's bytes
    cache_policy: str = "clock"  # the device cache's policy, "auto" resolved
    kv_tokens: int = 0  # positions the KV pool's full-attention blocks hold, over all sequences
    sequences: int = 1

    def describe(self) -> str:
        return (f"device {self.device}, {str(self.dtype).replace('torch.', '')}, context {self.max_context} tokens, "
                f"prefill chunk {self.prefill_chunk} tokens, slot {self.slot_bytes} B, floor {self.min_slots} slots, "
                f"policy {self.cache_policy}, KV pool {self.kv_tokens} tokens for {self.sequences} "
                f"sequence{'s' if self.sequences > 1 else ''}\n"
                + self.ledger.table(slots=self.slots, slot_bytes=self.slot_bytes, total_experts=self.total_experts))


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise MoestreamError(f"--device {name!r} is not a device (cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise MoestreamError("--device cuda was asked for, but no CUDA GPU is available")
    if device.type not in ("cpu", "cuda"):
        raise MoestreamError(f"--device {name!r}: only cpu and cuda are supported")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def free_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return psutil.virtual_memory().available


def plan_run(packed: PackedModel, options: EngineOptions, *, default_cache_size: str = "auto",
             digest_dir: str | None = None) -> RunPlan:
    """The run's shape. Every Engine starts here, so the resident files are checked here (unless
    options.verify is off; digests remembered in digest_dir): no engine runs on damaged weights."""
    if options.verify:
        check = check_resident_files(packed.directory, packed.manifest, cache_dir=digest_dir)
        if check.hashed:
            log.info("checked %d resident files (%d hashed, %.1f MB)", check.files, check.hashed, check.bytes_hashed / 1e6)
    device = resolve_device(options.device)
    dtype = resolve_dtype(options.dtype, device)
    args = family_module(packed.family).ModelArgs.from_dict(packed.config)
    default_context = BUDGET_DEFAULT_CONTEXT if options.memory_budget else MAX_DEFAULT_CONTEXT
    max_context = options.max_context or min(args.max_position_embeddings, default_context)
    if max_context < 2:
        raise MoestreamError(f"--max-context must be at least 2, got {max_context}")
    if options.max_sequences < 1:
        raise MoestreamError(f"max_sequences must be at least 1, got {options.max_sequences}")
    layers = packed.manifest.expert_layers
    if not layers:
        raise MoestreamError(f"{packed.directory}: the model has no routed experts")
    slot_bytes = max(e.record_size for e in layers)
    total = sum(e.num_experts for e in layers)
    # the floor: one token's experts in one layer at once (a layer that routes to more runs them in batches)
    floor = min(args.num_experts_per_tok, min(e.num_experts for e in layers))
    staging = STAGING_BUFFERS if device.type == "cuda" else 0
    host_slots = 0
    if options.host_cache_size not in ("0", "", "none"):
        host_slots = slots_for(options.host_cache_size, slot_bytes=slot_bytes, total_experts=total, min_slots=1,
                               flag="--host-cache-size")

    chunk = options.prefill_chunk_tokens
    # kept dequantized copies serve the torch reference only: none where the native kernels take the records
    unpacked_bytes = 0 if device.type == "cpu" and takes_every_layer(packed) else unpacked_expert_bytes(packed, dtype)
    most_unpacked = unpacked_limit(options, device, unpacked_bytes=unpacked_bytes, total_experts=total)

    resident = resident_bytes(packed, dtype, device)

    def ledger(slots: int, unpacked: int = most_unpacked) -> Ledger:
        return plan_ledger(args, resident=resident, dtype=dtype, max_context=max_context, chunk=chunk,
                           slots=slots, slot_bytes=slot_bytes, host_slots=host_slots, staging=staging,
                           cuda=device.type == "cuda", sequences=options.max_sequences,
                           unpacked=min(slots, unpacked) * unpacked_bytes if slots else unpacked * unpacked_bytes)

    size = options.cache_size if options.cache_size != "auto" else default_cache_size
    if options.memory_budget:
        budget = parse_bytes(options.memory_budget)
        while chunk > MIN_BUDGET_CHUNK and ledger(0).workspace > BUDGET_WORKSPACE_SHARE * budget:
            chunk //= 2  # a smaller prefill pass: slower prefill, more experts resident for decode
        slots = slots_within(budget, ledger(0), slot_bytes=slot_bytes, min_slots=floor, total_experts=total)
        if size != "auto":
            slots = min(slots, slots_for(size, slot_bytes=slot_bytes, total_experts=total, min_slots=floor))
    elif size == "auto":
        budget = int(free_memory(device) * 0.85) - (host_slots * slot_bytes if device.type == "cpu" else 0)
        slots = slots_within(budget, ledger(0), slot_bytes=slot_bytes, min_slots=floor, total_experts=total)
    else:
        slots = slots_for(size, slot_bytes=slot_bytes, total_experts=total, min_slots=floor)
    working_set = args.num_experts_per_tok * len(layers)  # (layer, expert) pairs one token touches
    return RunPlan(device=device, dtype=dtype, max_context=max_context, slots=slots, host_slots=host_slots,
                   slot_bytes=slot_bytes, total_experts=total, min_slots=floor, staging=staging, ledger=ledger(slots),
                   prefill_chunk=chunk, unpacked=min(slots, most_unpacked), unpacked_bytes=unpacked_bytes,
                   cache_policy=resolve_policy(options.cache_policy, slots=slots, working_set=working_set),
                   kv_tokens=kv_pool_tokens(args, sequences=options.max_sequences, max_context=max_context),
                   sequences=options.max_sequences)


def kv_pool_tokens(args, *, sequences: int, max_context: int) -> int:
    """Positions a full-attention layer's blocks hold, over all sequences (moestream.kv.pool.full_blocks)."""
    layout = args.kv_layout()
    max_blocks = -(-max_context // BLOCK_SIZE)
    return BLOCK_SIZE * full_blocks(sequences, max_blocks, recurrent=any(s.recurrent for s in layout))


def unpacked_limit(options: EngineOptions, device: torch.device, *, unpacked_bytes: int, total_experts: int) -> int:
    """Experts whose dequantized copies a CPU run may keep (the slots bound it too): none on CUDA,
    else what fits in UNPACKED_SHARE of the memory budget (or of free RAM)."""
    if device.type != "cpu" or unpacked_bytes <= 0:
        return 0
    room = parse_bytes(options.memory_budget) if options.memory_budget else free_memory(device)
    return min(total_experts, int(room * UNPACKED_SHARE) // unpacked_bytes)


def resolve_policy(name: str, *, slots: int, working_set: int) -> str:
    """"auto": lfu where the pool is smaller than one token's experts (every recency policy then evicts
    each expert just before its next use), clock elsewhere (O(1) victims; lfu scans every slot)."""
    if name != "auto":
        return name
    return "lfu" if slots < working_set else "clock"


def resolve_expert_source(name: str, device: torch.device) -> str:
    """"auto": mmap on the CPU (a miss is a copy out of the page cache on the computing thread; the
    direct source's reader threads cost it their hand-offs and the GIL: 1.1-1.5x slower on the demo
    model), direct on a GPU (O_DIRECT reads straight into pinned buffers)."""
    if name != "auto":
        return name
    return "mmap" if device.type == "cpu" else "direct"


def choose_threads(*, cores: int, load: float, streaming: bool) -> int:
    """Compute threads for the CPU: this process's cores, less one for the expert readers when experts
    stream, less the machine's load; at least 1 (more threads than free cores only wait on each
    other at every operation's barrier)."""
    readers = 1 if streaming else 0
    return max(1, cores - readers - int(load + 0.5))


def machine_cores_and_load() -> tuple[int, float]:
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        load = os.getloadavg()[0]
    except (AttributeError, OSError):
        load = 0.0
    return cores, load


def resolve_options(packed: PackedModel, options: EngineOptions, *, default_cache_size: str = "auto",
                    digest_dir: str | None = None) -> EngineOptions:
    """Options with the defaults that depend on the machine and the model decided (threads: 0 ->
    `choose_threads`). The one place generate, serve and bench resolve them, before an Engine exists."""
    if options.threads > 0:
        return options
    plan = plan_run(packed, options, default_cache_size=default_cache_size, digest_dir=digest_dir)
    cores, load = machine_cores_and_load()
    streaming = plan.slots < plan.total_experts
    threads = choose_threads(cores=cores, load=load, streaming=streaming)
    log.info("compute threads: %d (%d cores, load %.2f, experts %s)", threads, cores, load,
             "streaming" if streaming else "all resident")
    return replace(options, threads=threads)


def run_facts(options: EngineOptions) -> dict:
    """What a receipt records about how the run was set up, beyond the engine's own figures."""
    facts = {"threads": torch.get_num_threads(), "verify": options.verify}
    if options.cpu_experts != "off":
        facts["cpu_experts"] = options.cpu_experts
    return facts
