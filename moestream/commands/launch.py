"""Starting expert-parallel ranks from the command line: under torchrun (its environment), or N
processes spawned here for `--devices cpu,cpu` / `--devices cuda:0,cuda:1`.

This is the command-line layer: the only place that reads RANK / WORLD_SIZE / LOCAL_RANK and
initializes torch.distributed. The library gets the resulting ExpertGroup through EngineOptions."""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from datetime import timedelta
from typing import Callable

import torch

from moestream.errors import MoestreamError
from moestream.flag_values import at_least

DEFAULT_TIMEOUT_S = 300  # a collective that waits longer stops the run: a rank has died or hangs


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("expert parallel (one rank per device; each holds a share of the experts)")
    g.add_argument("--devices", type=parse_devices, default=None, metavar="DEV,DEV,...",
                   help="one process per device (cpu,cpu or cuda:0,cuda:1), the experts split between them")
    g.add_argument("--expert-placement", default=None, metavar="TRACE",
                   help="balance experts over the ranks by a routing trace's counts (default: e on rank e %% ranks)")
    g.add_argument("--dist-timeout", type=at_least(1), default=DEFAULT_TIMEOUT_S, metavar="SECONDS",
                   help=f"stop when an exchange between ranks waits longer (default {DEFAULT_TIMEOUT_S})")


def parse_devices(text: str) -> list[str]:
    devices = [d.strip() for d in text.split(",") if d.strip()]
    if not devices:
        raise argparse.ArgumentTypeError("needs at least one device, e.g. cpu,cpu or cuda:0,cuda:1")
    kinds = set()
    for d in devices:
        try:
            kinds.add(torch.device(d).type)
        except RuntimeError:
            raise argparse.ArgumentTypeError(f"{d!r} is not a device (cpu or cuda:N)") from None
    if kinds - {"cpu", "cuda"}:
        raise argparse.ArgumentTypeError("only cpu and cuda:N devices are supported")
    if len(kinds) > 1:
        raise argparse.ArgumentTypeError("all devices must be of one kind (all cpu, or all cuda:N)")
    return devices


def torchrun_rank(environ: dict | None = None) -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when started by torchrun with more than one process, else None."""
    environ = os.environ if environ is None else environ
    try:
        world = int(environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return None
        return int(environ["RANK"]), world, int(environ.get("LOCAL_RANK", environ["RANK"]))
    except (KeyError, ValueError):
        raise MoestreamError("WORLD_SIZE is set but RANK is missing or not a number (start ranks with torchrun)") from None


def init_group(rank: int, world_size: int, *, device: str, init_method: str, timeout_s: float):
    """Join the process group (gloo on CPU, NCCL on CUDA); the ExpertGroup for EngineOptions."""
    import torch.distributed as dist

    from moestream.layers.expert_parallel import ExpertGroup

    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise MoestreamError(f"rank {rank}: device {device} asked for, but no CUDA GPU is available")
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    try:
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), **kwargs)
    except (RuntimeError, ValueError) as exc:
        raise MoestreamError(f"rank {rank}: could not join the {world_size} ranks ({backend}): "
                             f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}") from None
    return ExpertGroup(rank=rank, world_size=world_size, timeout_s=timeout_s)


def leave_group() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def spawn_ranks(devices: list[str], target: Callable, *args) -> int:
    """Run target(rank, devices, init_method, *args) in one process per device; 0 when every rank
    returned 0, else 1 (each failing rank has printed its own error)."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="moestream-ranks-") as folder:
        init_method = f"file://{os.path.join(folder, 'store')}"
        try:
            mp.spawn(target, args=(devices, init_method, *args), nprocs=len(devices), join=True)
        except mp.ProcessExitedException:
            return 1
        except mp.ProcessRaisedException as exc:
            print(f"moestream: a rank failed: {str(exc).strip().splitlines()[-1]}", file=sys.stderr)
            return 1
    return 0
