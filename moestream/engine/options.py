"""Options of anything that runs the engine (generate, serve, bench), as flags and as a dataclass."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, fields


@dataclass
class EngineOptions:
    device: str = "auto"  # auto: cuda when available
    dtype: str = "auto"  # auto: bfloat16 on cuda, float32 on cpu
    max_context: int = 0  # 0: the model's max_position_embeddings (at most 32768)
    prefill_chunk_tokens: int = 512

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "EngineOptions":
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--max-context", type=int, default=0, help="prompt + completion limit in tokens (default: the model's, at most 32768)")
    g.add_argument("--prefill-chunk-tokens", type=int, default=512, help="prompt tokens per prefill pass (default 512)")
