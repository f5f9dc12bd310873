"""`moestream simulate TRACE`: hit rates of cache policies and sizes over recorded routing traces."""
from __future__ import annotations

import argparse
import json
import math
import sys
import zipfile

import numpy as np

from moestream.bench.plots import pyplot, save_png
from moestream.commands.args import Parser, check_output_paths, fail
from moestream.errors import MoestreamError
from moestream.experts.policy import POLICY_NAMES
from moestream.sim.belady import belady
from moestream.sim.simulate import DEVICE_POLICIES, simulate, simulate_device, total_experts
from moestream.experts.trace import RoutingTrace


NOT_A_TRACE = "not a routing trace (the .npz file --trace-routing writes)"


def parse_size_spec(text: str) -> list[str]:
    """"10%,25%,8" -> the items; each a share in (0, 100] % or a slot count >= 1 (else ArgumentTypeError)."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError("no sizes given")
    for item in items:
        share = item.endswith("%")
        try:
            value = float(item[:-1]) if share else int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} is neither a share (25%) nor a slot count (64)") from None
        if share and not (math.isfinite(value) and 0 < value <= 100):
            raise argparse.ArgumentTypeError(f"{item!r}: a share must be more than 0% and at most 100%")
        if not share and value < 1:
            raise argparse.ArgumentTypeError(f"{item!r}: a slot count must be at least 1")
    return items


def parse_sizes(items: list[str] | str, total: int, floor: int) -> list[tuple[str, int]]:
    """Each item as slots, never below the floor (one token's experts)."""
    out = []
    for item in parse_size_spec(items) if isinstance(items, str) else items:
        slots = round(float(item[:-1]) / 100 * total) if item.endswith("%") else int(item)
        out.append((item, max(slots, floor)))
    return out


# opt: Belady's optimum, the bound no real policy passes; device-*: the device-driven path's rules
SIM_POLICIES = (*POLICY_NAMES, "opt", *DEVICE_POLICIES)


def parse_policies(text: str) -> list[str]:
    policies = [p.strip() for p in text.split(",") if p.strip()]
    for policy in policies:
        if policy not in SIM_POLICIES:
            raise argparse.ArgumentTypeError(f"unknown policy {policy!r} (choose from {', '.join(SIM_POLICIES)})")
    if not policies:
        raise argparse.ArgumentTypeError("no policies given")
    return policies


def load_trace(path: str) -> RoutingTrace:
    """A routing trace, or a MoestreamError saying why the file is not one."""
    try:
        trace = RoutingTrace.load(path)
    except FileNotFoundError:
        raise MoestreamError(f"{path}: no such file") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError, EOFError, zipfile.BadZipFile):
        raise MoestreamError(f"{path}: {NOT_A_TRACE}") from None
    n = len(trace.layer)
    if (trace.experts.ndim != 2 or trace.layer.ndim != 1 or trace.experts.shape[0] != n or n == 0
            or not np.issubdtype(trace.experts.dtype, np.integer) or int(trace.experts.min()) < 0):
        raise MoestreamError(f"{path}: {NOT_A_TRACE}")
    return trace


def main(argv: list[str] | None = None) -> int:
    p = Parser(prog="moestream simulate", description=__doc__)
    p.add_argument("traces", nargs="+", help="routing trace files (.npz, from --trace-routing)")
    p.add_argument("--sizes", type=parse_size_spec, default="10%,25%,50%",
                   help="cache sizes: shares of all experts or slot counts (default 10%%,25%%,50%%)")
    p.add_argument("--policies", type=parse_policies, default="clock,lru",
                   help=f"comma-separated, from {', '.join(SIM_POLICIES)} (opt: Belady's optimum, a bound; "
                        "device-cycle / device-lru: the device-driven path's map and rule, at "
                        "least twice a layer's experts (a smaller size is skipped, said on stderr); default clock,lru)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.add_argument("--plot", metavar="FILE.png", help="also draw hit rate against cache size, a line per policy "
                                                       "(the mean over the traces; opt dashed, as the bound)")
    args = p.parse_args(argv)
    check_output_paths(p, args, {"plot": "--plot"})
    rows = []
    try:
        traces = [(path, load_trace(path)) for path in args.traces]  # every file checked before any work
        for path, trace in traces:
            total = total_experts(trace)
            for label, slots in parse_sizes(args.sizes, total, trace.experts.shape[1]):
                for policy in args.policies:
                    if policy == "opt":
                        r = belady(trace, slots=slots)
                    elif policy in DEVICE_POLICIES:
                        try:
                            r = simulate_device(trace, slots=slots, policy=policy)
                        except MoestreamError as exc:  # below the map's minimum: the other rows stand
                            print(f"moestream simulate: skipped: {exc}", file=sys.stderr)
                            continue
                    else:
                        r = simulate(trace, slots=slots, policy=policy)
                    rows.append({"trace": path, "size": label, "slots": slots, "policy": policy,
                                 "hit_rate": round(r.hit_rate, 4), "hits": r.hits, "misses": r.misses})
    except MoestreamError as exc:
        return fail("moestream simulate", str(exc))
    if args.plot:
        plot_hit_rates(rows, args.plot)
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'trace':<40} {'size':>6} {'slots':>6} {'policy':>12} {'hit rate':>9}")
        for r in rows:
            print(f"{r['trace'][-40:]:<40} {r['size']:>6} {r['slots']:>6} {r['policy']:>12} {r['hit_rate']:>9.3f}")
    return 0


def plot_hit_rates(rows: list[dict], path: str) -> None:
    """Hit rate against slots, one line per policy (mean over the traces), Belady's optimum dashed."""
    fig, ax = pyplot().subplots(figsize=(6.4, 4.2))
    for policy in dict.fromkeys(r["policy"] for r in rows):
        by_size: dict[int, list[float]] = {}
        for r in rows:
            if r["policy"] == policy:
                by_size.setdefault(r["slots"], []).append(r["hit_rate"])
        sizes = sorted(by_size)
        ax.plot(sizes, [sum(by_size[s]) / len(by_size[s]) for s in sizes], marker="o",
                linestyle="--" if policy == "opt" else "-", label="opt (Belady, bound)" if policy == "opt" else policy)
    ax.set_xlabel("cache slots")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    save_png(fig, path)
