"""The engine's flags (generate, serve, bench), the EngineOptions they give, and the refusals that
argparse's types do not make: sizes that can never give a cache, more compute threads than the
machine has, a device that is no device, a context longer than the model's (exit 2, one line,
before any model is loaded). And where this process's environment keeps resident files' digests."""
from __future__ import annotations

import argparse
import os
from dataclasses import fields, replace

from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.experts.sizing import parse_bytes
from moestream.flag_values import at_least

CACHE_DIR_ENV = "MOESTREAM_CACHE_DIR"  # read here, never in the library
NAMED_SIZES = ("auto", "min", "all", "max")


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
    c.add_argument("--expert-source", default="auto", choices=["auto", "direct", "mmap"],
                   help="direct: O_DIRECT reads by a thread pool; mmap: the page cache is the host tier (default "
                        "auto: mmap on the CPU, direct on a GPU)")
    c.add_argument("--host-cache-size", default="0", help="pinned host RAM tier between disk and device slots (bytes or %%; default 0: none)")
    c.add_argument("--host-cache-policy", default="clock", choices=["clock", "lru", "arc", "lfu"], help="host tier policy (default clock)")
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


def digest_dir(environ=os.environ) -> str | None:
    """Where the digests of checked resident files are remembered: $MOESTREAM_CACHE_DIR where set,
    else None (the library's default, ~/.cache/moestream)."""
    return environ.get(CACHE_DIR_ENV) or None


def size_problem(text: str, *, zero_ok: bool = False) -> str | None:
    """Why a --cache-size-style value can never be a size (None: it may be; whether it fits the
    model is the plan's to say): a share outside (0%, 100%], zero bytes, text that is no size."""
    value = text.strip().lower()
    if value in NAMED_SIZES or (zero_ok and value in ("0", "none")):
        return None
    if value.endswith("%"):
        try:
            share = float(value[:-1])
        except ValueError:
            return f"cannot read share {text!r} (example: 25%)"
        return None if 0 < share <= 100 else f"a share must be in (0%, 100%], not {text}"
    try:
        size = parse_bytes(value)
    except MoestreamError as exc:
        return str(exc)
    return None if size > 0 else f"{text} holds no expert (give bytes like 4GiB, a share like 25%, min or all)"


def machine_cores() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def device_problem(name: str) -> str | None:
    """Why --device names no device (None: it does; whether that device is here is the plan's to say)."""
    import torch

    if name == "auto":
        return None
    try:
        kind = torch.device(name).type
    except RuntimeError:
        return f"{name!r} is not a device (cpu, cuda or cuda:N)"
    return None if kind in ("cpu", "cuda") else f"{name!r}: only cpu and cuda are supported"


def model_positions(model: str | None) -> int | None:
    """The model's max_position_embeddings (None where MODEL is no packed model: loading it says why)."""
    from moestream.engine.engine import DEMO_MODEL
    from moestream.format.reader import PackedModel
    from moestream.models.registry import family_module

    try:
        packed = PackedModel(model or DEMO_MODEL)
        return family_module(packed.family).ModelArgs.from_dict(packed.config).max_position_embeddings
    except (MoestreamError, OSError, KeyError, ValueError):
        return None


def check_engine_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--cache-size, --host-cache-size, --memory-budget, --threads, --device and --max-context."""
    for flag, attr, zero_ok in (("--cache-size", "cache_size", False), ("--host-cache-size", "host_cache_size", True)):
        problem = size_problem(getattr(args, attr), zero_ok=zero_ok)
        if problem:
            parser.error(f"argument {flag}: {problem}")
    if args.memory_budget is not None:
        try:
            parse_bytes(args.memory_budget)
        except MoestreamError as exc:
            parser.error(f"argument --memory-budget: {exc}")
    problem = device_problem(args.device)
    if problem:
        parser.error(f"argument --device: {problem}")
    cores = machine_cores()
    if args.threads > cores:  # more compute threads than cores only wait on each other at every barrier
        parser.error(f"argument --threads: {args.threads} is more than the {cores} cores this process may use")
    if args.max_context:  # the KV cache is sized for the whole context: past the model's positions it only costs
        positions = model_positions(args.model)
        if positions is not None and args.max_context > positions:
            parser.error(f"argument --max-context: {args.max_context} is more than the model's {positions} positions")
    if args.memory_budget is not None:
        problem = budget_problem(args)
        if problem:
            parser.error(problem)


def budget_problem(args: argparse.Namespace) -> str | None:
    """Why --memory-budget cannot hold this model (its fixed parts and fewest slots), found from the
    plan before anything is loaded or hashed; None where it can, or where loading will say what is wrong."""
    from moestream.engine.engine import open_packed
    from moestream.engine.plan import plan_run
    from moestream.errors import BudgetError

    try:
        packed, default_size = open_packed(args.model)
        plan_run(packed, replace(options_from_args(args), verify=False), default_cache_size=default_size)
    except BudgetError as exc:
        return str(exc)
    except (MoestreamError, OSError, KeyError, ValueError):
        return None
    return None
