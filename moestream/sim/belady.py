"""Belady's optimum (OPT): the best hit rate any replacement policy could get on a trace, as a bound.

On a miss with every slot taken, OPT evicts the cached expert whose next use lies farthest ahead
(never, first). It knows the future, so no real cache can run it; the simulator draws it beside the
real policies. As in the engine, one token's experts in one layer are held together while they are
used, so a victim is never one of them."""
from __future__ import annotations

import heapq

from moestream.sim.simulate import SimResult
from moestream.experts.trace import RoutingTrace

NEVER = float("inf")


def belady(trace: RoutingTrace, *, slots: int) -> SimResult:
    groups = [[(layer, e) for e in sorted(set(row))] for layer, row in zip(trace.layer.tolist(), trace.experts.tolist())]
    # next_use[g][i]: the group index where groups[g][i] is asked for again (NEVER: not again)
    next_use: list[list[float]] = [[] for _ in groups]
    seen: dict = {}
    for g in range(len(groups) - 1, -1, -1):
        next_use[g] = [seen.get(key, NEVER) for key in groups[g]]
        for key in groups[g]:
            seen[key] = g
    cached: dict = {}  # key -> its next use
    heap: list = []  # (-next use, key): the farthest first; stale entries are skipped
    hits = misses = 0
    for g, group in enumerate(groups):
        current = set(group)
        for key, nxt in zip(group, next_use[g]):
            if key in cached:
                hits += 1
            else:
                misses += 1
                if len(cached) >= slots:
                    held = []
                    while True:
                        far, victim = heapq.heappop(heap)
                        if cached.get(victim) != -far:
                            continue  # stale
                        if victim in current:
                            held.append((far, victim))
                            continue
                        del cached[victim]
                        break
                    for item in held:
                        heapq.heappush(heap, item)
            cached[key] = nxt
            heapq.heappush(heap, (-nxt, key))
    return SimResult("opt", slots, hits, misses)
