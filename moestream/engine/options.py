"""Options of anything that runs the engine (generate, serve, bench); their flags are in
moestream.commands.engine_args."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineOptions:
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    max_context: int = 0  # 0: the model's max_position_embeddings (at most 32768)
    prefill_chunk_tokens: int = 2048  # each pass streams the experts it routes to once
    threads: int = 0  # CPU compute threads; 0: torch's default (the CLI resolves it: plan.choose_threads)
    cache_size: str = "auto"
    cache_policy: str = "auto"  # clock, or lfu where the pool is smaller than one token's experts
    expert_source: str = "auto"  # auto: mmap on the CPU (no reader threads to wait on), direct on a GPU
    host_cache_size: str = "0"
    host_cache_policy: str = "clock"
    # the lookahead's fitted correction (moestream fit-lookahead): auto (MODEL/lookahead.safetensors where it
    # exists), none, or a file
    lookahead_maps: str = "auto"
    memory_budget: str | None = None
    verify: bool = True  # crc32 of every expert record read, sha256 of the resident files at load
    trace_routing: str | None = None
    max_sequences: int = 1  # sequence slots decoding together (Engine.step_many), each with its own KV cache
    # expert parallelism: a moestream.layers.expert_parallel.ExpertGroup (the CLI initializes the
    # process group); each rank holds and computes its share of the experts. None: one process
    expert_parallel: object = None
    expert_placement: str | None = None  # a routing trace (.npz): experts balanced over ranks by its counts
    # the CPU computes a share of each streamed layer's misses from host RAM (with device-driven
    # streaming, where the native worker builds): "off", "auto" or "0".."1"
    cpu_experts: str = "auto"
