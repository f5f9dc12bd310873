"""Summarize a `--timeline` trace: time per kind of work, and the compute device's idle time by cause.

- Work: per track (the main thread, each reader thread, the device) and span name, the count, the
  total time and the self time (less the spans nested inside it on the same track).
- Idle: the compute track is the device's (`cat: device`, CUDA) or, on the CPU, the main thread's
  decoder segments (`cat: compute`). Between its first and last span, every gap is charged to the
  innermost main-thread span open at that moment (`wait_reads`: waiting for expert reads; `sync`:
  waiting for the router's ids; `load`: the cache's own work; `sample`, ...), or to `untraced host
  work` where none is open.

`moestream timeline TRACE.json [--json]`."""
from __future__ import annotations

from collections import defaultdict

UNTRACED = "untraced host work"


class TraceError(ValueError):
    pass


def _spans(trace) -> list[dict]:
    events = trace.get("traceEvents") if isinstance(trace, dict) else trace
    if not isinstance(events, list):
        raise TraceError("not a Chrome trace (no traceEvents)")
    return [e for e in events if isinstance(e, dict) and e.get("ph") == "X" and "ts" in e and "dur" in e]


def _thread_names(trace) -> dict[int, str]:
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    return {e["tid"]: e["args"]["name"] for e in events
            if isinstance(e, dict) and e.get("ph") == "M" and e.get("name") == "thread_name" and "tid" in e}


def _main_tid(spans: list[dict]) -> int:
    """The thread that ran the steps (the engine's)."""
    for name in ("step", "prefill_chunk", "load"):
        tids = [e["tid"] for e in spans if e["name"] == name and e.get("cat") != "device"]
        if tids:
            return max(set(tids), key=tids.count)
    raise TraceError("no step, prefill_chunk or load span (is this a moestream --timeline trace?)")


def _self_times(spans: list[dict]) -> list[float]:
    """Each span's duration less its directly nested spans' (spans of one track nest, never cross)."""
    order = sorted(range(len(spans)), key=lambda i: (spans[i]["ts"], -spans[i]["dur"]))
    own = [float(e["dur"]) for e in spans]
    stack: list[int] = []
    for i in order:
        start = spans[i]["ts"]
        while stack and spans[stack[-1]]["ts"] + spans[stack[-1]]["dur"] <= start:
            stack.pop()
        if stack:
            own[stack[-1]] -= spans[i]["dur"]
        stack.append(i)
    return own


def _cause(host: list[dict], t0: float, t1: float) -> dict[str, float]:
    """Time in [t0, t1) by the innermost host span open (the latest started among those open)."""
    cuts = sorted({t0, t1, *[max(t0, min(t1, e["ts"])) for e in host],
                   *[max(t0, min(t1, e["ts"] + e["dur"])) for e in host]})
    out: dict[str, float] = defaultdict(float)
    for a, b in zip(cuts, cuts[1:]):
        if b <= a:
            continue
        mid = (a + b) / 2
        open_ = [e for e in host if e["ts"] <= mid < e["ts"] + e["dur"]]
        name = max(open_, key=lambda e: (e["ts"], -e["dur"]))["name"] if open_ else UNTRACED
        out[name] += b - a
    return out


def summarize(trace) -> dict:
    """{"work": [{track, name, count, total_ms, self_ms}], "compute": {...}, "idle_ms": {cause: ms}}."""
    spans = _spans(trace)
    if not spans:
        raise TraceError("has no spans")
    names = _thread_names(trace)
    main = _main_tid(spans)
    work: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    by_track: dict[tuple, list[dict]] = defaultdict(list)
    for e in spans:
        by_track[(e.get("tid"), e.get("cat") == "device")].append(e)
    for (tid, device), track_spans in by_track.items():
        track = "device" if device else ("main" if tid == main else names.get(tid, f"thread {tid}"))
        for e, own in zip(track_spans, _self_times(track_spans)):
            row = work[(track, e["name"])]
            row[0] += 1
            row[1] += e["dur"]
            row[2] += own
    device = [e for e in spans if e.get("cat") == "device"]
    compute = device or [e for e in spans if e.get("cat") == "compute" and e.get("tid") == main]
    result = {"work": [{"track": t, "name": n, "count": c, "total_ms": round(total / 1e3, 3), "self_ms": round(own / 1e3, 3)}
                       for (t, n), (c, total, own) in sorted(work.items(), key=lambda kv: -kv[1][1])],
              "compute": {"track": "device" if device else "cpu (decoder segments)"}}
    if not compute:
        result["compute"].update(busy_ms=0.0, window_ms=0.0, idle_ms=0.0)
        result["idle_ms"] = {}
        return result
    compute.sort(key=lambda e: e["ts"])
    host = [e for e in spans if e.get("tid") == main and e.get("cat") in ("host", "launch", None)]
    idle: dict[str, float] = defaultdict(float)
    busy, reach = 0.0, compute[0]["ts"]
    for e in compute:
        end = e["ts"] + e["dur"]
        if e["ts"] > reach:
            for cause, t in _cause(host, reach, e["ts"]).items():
                idle[cause] += t
        busy += max(0.0, end - max(reach, e["ts"]))
        reach = max(reach, end)
    window = reach - compute[0]["ts"]
    result["compute"].update(busy_ms=round(busy / 1e3, 3), window_ms=round(window / 1e3, 3),
                             idle_ms=round((window - busy) / 1e3, 3))
    result["idle_ms"] = {k: round(v / 1e3, 3) for k, v in sorted(idle.items(), key=lambda kv: -kv[1])}
    return result


def render(summary: dict) -> str:
    lines = [f"{'track':<16} {'span':<16} {'count':>7} {'total ms':>11} {'self ms':>11}"]
    for row in summary["work"]:
        lines.append(f"{row['track'][:16]:<16} {row['name'][:16]:<16} {row['count']:>7} {row['total_ms']:>11.3f} "
                     f"{row['self_ms']:>11.3f}")
    c = summary["compute"]
    lines += ["", f"compute ({c['track']}): busy {c['busy_ms']:.3f} ms of {c['window_ms']:.3f} ms, "
                  f"idle {c['idle_ms']:.3f} ms"]
    for cause, ms in summary["idle_ms"].items():
        share = ms / c["idle_ms"] * 100 if c["idle_ms"] else 0.0
        lines.append(f"  idle in {cause:<24} {ms:>11.3f} ms  {share:5.1f} %")
    return "\n".join(lines)
