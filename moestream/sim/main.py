"""`moestream simulate TRACE`: hit rates of cache policies and sizes over recorded routing traces."""
from __future__ import annotations

import argparse
import json
import sys

from moestream.errors import MoestreamError
from moestream.experts.policy import POLICY_NAMES
from moestream.sim.simulate import simulate, total_experts
from moestream.sim.trace import RoutingTrace


def parse_sizes(text: str, total: int, floor: int) -> list[tuple[str, int]]:
    out = []
    for item in text.split(","):
        item = item.strip()
        slots = round(float(item[:-1]) / 100 * total) if item.endswith("%") else int(item)
        out.append((item, max(slots, floor)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moestream simulate", description=__doc__)
    p.add_argument("traces", nargs="+", help="routing trace files (.npz, from --trace-routing)")
    p.add_argument("--sizes", default="10%,25%,50%", help="cache sizes: shares of all experts or slot counts (default 10%%,25%%,50%%)")
    p.add_argument("--policies", default="clock,lru", help=f"comma-separated, from {', '.join(POLICY_NAMES)} (default clock,lru)")
    p.add_argument("--partition", default="shared", choices=["shared", "per-layer"])
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = p.parse_args(argv)
    rows = []
    try:
        for path in args.traces:
            try:
                trace = RoutingTrace.load(path)
            except (OSError, ValueError, KeyError) as exc:
                raise MoestreamError(f"{path}: not a routing trace ({exc})") from None
            total = total_experts(trace)
            floor = trace.experts.shape[1] * (len(set(trace.layer.tolist())) if args.partition == "per-layer" else 1)
            for label, slots in parse_sizes(args.sizes, total, floor):
                for policy in args.policies.split(","):
                    if policy not in POLICY_NAMES:
                        raise MoestreamError(f"unknown policy {policy!r} (choose from {', '.join(POLICY_NAMES)})")
                    r = simulate(trace, slots=slots, policy=policy, partition=args.partition)
                    rows.append({"trace": path, "size": label, "slots": slots, "policy": policy,
                                 "hit_rate": round(r.hit_rate, 4), "hits": r.hits, "misses": r.misses})
    except MoestreamError as exc:
        print(f"moestream simulate: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print(f"{'trace':<40} {'size':>6} {'slots':>6} {'policy':>6} {'hit rate':>9}")
        for r in rows:
            print(f"{r['trace'][-40:]:<40} {r['size']:>6} {r['slots']:>6} {r['policy']:>6} {r['hit_rate']:>9.3f}")
    return 0
