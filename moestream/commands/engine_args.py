"""The engine's flags (generate, serve, bench) and the EngineOptions they give."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields

from moestream.engine.options import EngineOptions
from moestream.flag_values import at_least


def options_from_args(args: argparse.Namespace) -> EngineOptions:
    return EngineOptions(**{f.name: getattr(args, f.name) for f in fields(EngineOptions) if hasattr(args, f.name)})


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--device", default="auto", help="cpu, cuda or cuda:N (default: cuda when available)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="compute dtype (default: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--max-context", type=at_least(2), default=0, help="prompt + completion limit in tokens (default: the model's, at most 32768)")
    g.add_argument("--prefill-chunk-tokens", type=at_least(1), default=2048,
                   help="prompt tokens per prefill pass (default 2048; each pass streams its experts once)")
    g.add_argument("--threads", type=at_least(1), default=0,
                   help="CPU compute threads (default: the cores this process may use, less the machine's load and "
                        "a core for the expert readers when experts stream)")
    c = parser.add_argument_group("expert cache")
    c.add_argument("--cache-size", default="auto",
                   help="device expert slots: bytes (4GiB), a share of all experts (25%%), min, all; "
                        "default auto: what fits in free memory (the demo model: 30%%)")
    c.add_argument("--cache-policy", default="auto", choices=["auto", "clock", "lru", "arc", "lfu"],
                   help="slot replacement policy (default auto: clock, or lfu where the pool holds fewer slots than "
                        "one token's experts across all layers). Device-driven streaming has its own: lru with "
                        "lru, else cycle (recency counted in each layer's own lookups, ties to the layer that "
                        "comes next latest)")
    c.add_argument("--expert-source", default="direct", choices=["direct", "mmap"],
                   help="direct: O_DIRECT reads by a thread pool (default); mmap: the page cache is the host tier")
    c.add_argument("--host-cache-size", default="0", help="pinned host RAM tier between disk and device slots (bytes or %%; default 0: none)")
    c.add_argument("--host-cache-policy", default="clock", choices=["clock", "lru", "arc", "lfu"], help="host tier policy (default clock)")
    c.add_argument("--streaming", default="auto", choices=["auto", "device", "host"],
                   help="who finds a streamed layer's experts: device (the GPU looks up its slots and copies misses from "
                        "the host tier itself, no host round trip per layer; needs a host tier holding every expert, "
                        "--host-cache-size all), host (the host reads each layer's ids, then loads); auto (default): "
                        "device where it can run on CUDA, else host")
    c.add_argument("--lookahead-maps", type=maps_arg, default="auto", metavar="auto|none|FILE",
                   help="fitted corrections of the lookahead's guesses (moestream fit-lookahead): auto (default: "
                        "MODEL/lookahead.safetensors where it exists), none (the plain routers), or a file; they "
                        "change which copies start early, never the output")
    c.add_argument("--memory-budget", default=None, metavar="SIZE", help="size everything to fit SIZE of device memory; refuse if impossible")
    c.add_argument("--no-verify", dest="verify", action="store_false",
                   help="skip the integrity checks (on by default: each expert record's crc32 as it is read, the "
                        "resident files' sha256 at load, remembered in $MOESTREAM_CACHE_DIR or ~/.cache/moestream)")
    c.add_argument("--cpu-experts", type=cpu_share_arg, default="auto", metavar="off|auto|SHARE",
                   help="with device-driven streaming (CUDA), the CPU computes a share of each layer's missed experts "
                        "straight from the host tier while the device copies and computes the rest: SHARE of the "
                        "misses (0..1), auto (default: the share that makes both finish together, from measured "
                        "speeds, where the native CPU kernels build), or off. Output within the dtype's tolerance of "
                        "off, not bit for bit")
    c.add_argument("--trace-routing", default=None, metavar="FILE", help="record (layer, position, experts) of every token to FILE (.npz)")


def maps_arg(text: str) -> str:
    """--lookahead-maps: auto, none or an existing file."""
    if text not in ("auto", "none") and not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"no such file: {text}")
    return text


def cpu_share_arg(text: str) -> str:
    """--cpu-experts: off, auto or a share in 0..1 (kept as text: EngineOptions holds it so)."""
    from moestream.cpu_share.share import parse_share

    try:
        value = parse_share(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return value if isinstance(value, str) else repr(value)
