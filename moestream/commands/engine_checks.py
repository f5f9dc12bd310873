"""Refusals of the engine's flags (generate, serve, bench) that argparse's types do not make: sizes
that can never give a cache, more compute threads than the machine has, a device that is no
device, a context longer than the model's. Exit 2, one line, before any model is loaded. And where
this process's environment keeps resident files' digests."""
from __future__ import annotations

import argparse
import os

from moestream.errors import MoestreamError
from moestream.experts.sizing import parse_bytes

CACHE_DIR_ENV = "MOESTREAM_CACHE_DIR"  # read here, never in the library
NAMED_SIZES = ("auto", "min", "all", "max")


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
