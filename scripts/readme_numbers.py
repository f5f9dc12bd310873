"""The README's measured numbers, rendered from the committed benchmark JSON.

Every number in README.md that a file under docs/bench/ backs sits between a pair of markers,

    <!-- numbers:begin NAME --> ... <!-- numbers:end -->

and this script renders what belongs between them from the JSON, so the README cannot drift from
the measurements. A block whose begin marker ends its line is a block of lines (a table, a
paragraph), set off by blank lines; otherwise it is a phrase inside a sentence, and may not begin a
line (markdown would show that line as raw HTML).

    python scripts/readme_numbers.py           # rewrite README.md in place
    python scripts/readme_numbers.py --check   # exit 1 naming each block that differs from the JSON
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import textwrap
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
H200 = BENCH / "h200"

MARKER = re.compile(r"<!-- numbers:begin ([A-Za-z0-9_-]+) -->(.*?)<!-- numbers:end -->", re.DOTALL)
BEGIN = re.compile(r"<!-- numbers:begin\b")
END = "<!-- numbers:end -->"
WIDTH = 100  # the README's line length


class NumbersError(Exception):
    """A problem with the README's markers or the JSON they name: one line for the user."""


def load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise NumbersError(f"{path.relative_to(ROOT)}: missing") from None
    except json.JSONDecodeError as exc:
        raise NumbersError(f"{path.relative_to(ROOT)}: not JSON ({exc.msg}, line {exc.lineno})") from None


def run_at(data: dict, cache_size: str, path: Path) -> dict:
    for run in data["runs"]:
        if run["cache_size"] == cache_size:
            return run
    raise NumbersError(f"{path.relative_to(ROOT)}: no run at cache size {cache_size}")


def only_run(path: Path) -> dict:
    runs = load(path)["runs"]
    if len(runs) != 1:
        raise NumbersError(f"{path.relative_to(ROOT)}: expected one run, found {len(runs)}")
    return runs[0]


def prefill_tok_s(run: dict, tokens: int) -> float:
    for p in run["prefill"]:
        if p["tokens"] == tokens:
            return p["tok_s"]
    raise NumbersError(f"no prefill of {tokens} tokens in the {run['cache_size']} run")


def command(data: dict) -> str:
    """The bench command as a reader types it: `moestream ...`, without where its output went."""
    words = shlex.split(data["machine"]["command"])
    words[0] = "moestream"  # recorded as the script path or the console script
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--out", "--plot"):
            skip = True
        else:
            kept.append(word)
    return " ".join(kept)


def share(cache_size: str) -> str:
    return cache_size.replace("%", " %")


def tok_s(x: float) -> str:
    return f"{x:,.1f}"


def wrap(text: str) -> str:
    return textwrap.fill(text, WIDTH, break_long_words=False, break_on_hyphens=False)


# --- the blocks ---------------------------------------------------------------------------------


def demo_cache_sweep() -> str:
    path = BENCH / "cpu-demo-cache-sizes.json"
    data = load(path)
    runs = data["runs"]
    sizes = "/".join(r["cache_size"].rstrip("%") for r in runs)
    speeds = " / ".join(tok_s(r["decode"]["tok_s"]) for r in runs)
    hits = " / ".join(f"{r['decode']['hit_rate']:.2f}" for r in runs)
    return (f"Decode on the CPU at {sizes} % cache: {speeds} tok/s\n"
            f"(decode hit rate {hits}):\n`{command(data)}`")


def h200_q30_cache_sizes() -> str:
    path = H200 / "qwen3-30b-a3b-decoder.json"
    data = load(path)
    intro = wrap(f"**Qwen3-30B-A3B shape** (random weights, 4-bit, one {data['machine']['gpu']}; "
                 f"`moestream synth --shape qwen3-30b-a3b /tmp/q30`, then `{command(data)}`; "
                 f"the rest of the experts in a pinned host tier):")
    rows = ["| device cache | decode | hit rate | prefill 2048 |", "|---|---|---|---|"]
    for run in data["runs"]:
        rows.append(f"| {share(run['cache_size'])} | {tok_s(run['decode']['tok_s'])} tok/s "
                    f"| {run['decode']['hit_rate']:.3f} | {prefill_tok_s(run, 2048):,.0f} tok/s |")
    cold = only_run(H200 / "qwen3-30b-a3b-cold.json")
    rows.append(f"| {share(cold['cache_size'])}, cold from disk | {tok_s(cold['decode']['tok_s'])} tok/s "
                f"| {cold['decode']['hit_rate']:.3f} "
                f"| reads at {cold['decode']['disk_gb_s_while_waiting']:.2f} GB/s while waiting (disk-bound) |")
    return intro + "\n\n" + "\n".join(rows)


def aba_25() -> list[dict]:
    """The A-B-A runs at 25 % with uniform routing: lookahead off, on, off."""
    names = ("off1", "on", "off2")
    return [only_run(H200 / f"stream-25pct-uniform-lookahead-{n}.json") for n in names]


def h200_uniform() -> str:
    sizes = load(H200 / "stream-uniform-sizes.json")
    by = {r["cache_size"]: r for r in sizes["runs"]}
    missing = {"100%", "50%", "10%"} - by.keys()
    if missing:
        raise NumbersError(f"docs/bench/h200/stream-uniform-sizes.json: no run at {', '.join(sorted(missing))}")
    aba = aba_25()
    speeds = [r["decode"]["tok_s"] for r in aba]
    hits = {f"{r['decode']['hit_rate']:.2f}" for r in aba}
    budget_path = H200 / "stream-budget8-uniform.json"
    budget_data = load(budget_path)
    budget = only_run(budget_path)
    words = shlex.split(budget_data["machine"]["command"])
    limit = words[words.index("--memory-budget") + 1]
    return (f"100 % {tok_s(by['100%']['decode']['tok_s'])} tok/s, "
            f"50 % {tok_s(by['50%']['decode']['tok_s'])} (hit rate {by['50%']['decode']['hit_rate']:.2f}), "
            f"25 % {min(speeds):.1f}–{max(speeds):.1f} ({'/'.join(sorted(hits))}; A-B-A runs,\n"
            f"lookahead off / on / off), 10 % {tok_s(by['10%']['decode']['tok_s'])} "
            f"({by['10%']['decode']['hit_rate']:.2f}); under `--memory-budget {limit}` "
            f"({100 * budget['slots'] / budget['total_experts']:.1f} % of the experts,\n"
            f"{budget['device_memory']['max_reserved'] / 2**30:.3f} GiB reserved) "
            f"{tok_s(budget['decode']['tok_s'])} tok/s")


def h200_device_uniform() -> str:
    path = H200 / "stream-device-uniform-sizes.json"
    by = {r["cache_size"]: r for r in load(path)["runs"]}
    missing = {"50%", "25%", "10%"} - by.keys()
    if missing:
        raise NumbersError(f"{path.relative_to(ROOT)}: no run at {', '.join(sorted(missing))}")
    budget_path = H200 / "stream-device-budget8-uniform.json"
    budget = only_run(budget_path)
    words = shlex.split(load(budget_path)["machine"]["command"])
    limit = words[words.index("--memory-budget") + 1]
    parts = [f"{size.rstrip('%')} % {tok_s(by[size]['decode']['tok_s'])}" + (" tok/s" if size == "50%" else "") +
             f" ({'hit rate ' if size == '50%' else ''}{by[size]['decode']['hit_rate']:.2f})" for size in ("50%", "25%", "10%")]
    return (", ".join(parts) + f"; under `--memory-budget {limit}`\n"
            f"({100 * budget['slots'] / budget['total_experts']:.1f} % of the experts, "
            f"{budget['device_memory']['max_reserved'] / 2**30:.3f} GiB reserved) {tok_s(budget['decode']['tok_s'])} tok/s")


def h200_device_25() -> str:
    runs = [run_at(load(H200 / "stream-device-uniform-sizes.json"), "25%", H200 / "stream-device-uniform-sizes.json"),
            only_run(H200 / "stream-device-25pct-uniform.json")]
    speeds = sorted(r["decode"]["tok_s"] for r in runs)
    return f"{speeds[0]:.1f}–{speeds[-1]:.1f} tok/s"


def h200_slot_map() -> str:
    """The Triton slot map against the torch lookup at 25 % (uniform), and under an 8 GiB budget."""
    triton = only_run(H200 / "stream-25pct-uniform-slot-map-triton.json")
    torch_ = only_run(H200 / "stream-25pct-uniform-slot-map-torch.json")
    budget_path = H200 / "stream-budget8-uniform-triton.json"
    budget = only_run(budget_path)
    words = shlex.split(load(budget_path)["machine"]["command"])
    limit = words[words.index("--memory-budget") + 1]
    link = triton["decode"]["bytes_read_host"] / triton["decode"]["s"] / 1e9
    return (f"25 % {tok_s(triton['decode']['tok_s'])} tok/s (hit rate {triton['decode']['hit_rate']:.2f}; the link "
            f"moving {link:.1f} GB/s) against {tok_s(torch_['decode']['tok_s'])} with the torch lookup; under "
            f"`--memory-budget {limit}` ({100 * budget['slots'] / budget['total_experts']:.1f} % of the experts, "
            f"{budget['device_memory']['max_reserved'] / 2**30:.2f} GiB reserved) {tok_s(budget['decode']['tok_s'])} tok/s")


def h200_decoder_ab() -> str:
    after = run_at(load(H200 / "arch-after.json"), "100%", H200 / "arch-after.json")
    before = run_at(load(H200 / "arch-before.json"), "100%", H200 / "arch-before.json")
    return f"{tok_s(after['decode']['tok_s'])} vs {tok_s(before['decode']['tok_s'])} tok/s before it"


def h200_gemv_tuned() -> str:
    runs = [only_run(H200 / f"resident-gemv-{name}.json") for name in ("before", "sweep-config", "tuned")]
    before, swept, tuned = (r["decode"]["tok_s"] for r in runs)
    return (f"{tok_s(before)} → {tok_s(swept)} tok/s in one call (the sweep's block sizes set through "
            f"`MOESTREAM_KERNEL_CONFIG`), {tok_s(tuned)} tok/s with them as the defaults")


def h200_vs_transformers() -> str:
    path = H200 / "qwen3-30b-a3b-4layers-vs-transformers-decoder.json"
    data = load(path)
    ours, theirs = only_run(path), data["transformers"]
    tokens = theirs["prefill_tokens"]
    decode = ours["decode"]["tok_s"]
    return (f"decode {decode / theirs['decode_tok_s']:.0f}× ({decode:,.0f} vs {theirs['decode_tok_s']:.1f} tok/s), "
            f"prefill of {tokens:,} tokens {prefill_tok_s(ours, tokens) / theirs['prefill_tok_s']:.1f}×")


def h200_4layers_25() -> str:
    path = H200 / "qwen3-30b-a3b-4layers-100-25.json"
    run = run_at(load(path), "25%", path)
    return f"hit rate {run['decode']['hit_rate']:.2f}, {run['decode']['tok_s']:.0f} tok/s"


def synth_hit_25() -> str:
    path = H200 / "qwen3-30b-a3b-decoder.json"
    run = run_at(load(path), "25%", path)
    return f"a 25 % cache hits about {100 * run['decode']['hit_rate']:.0f} %"


def crc32_cost() -> str:
    demo = load(BENCH / "crc32.json")["results"]["demo"]
    return (f"about {demo['crc32']['median_us']:.0f} µs per {demo['record_bytes'] / 1000:.0f} KB record, "
            f"{demo['crc32']['gb_s']:.1f} GB/s per core, against {demo['read_o_direct']['median_us']:.0f} µs "
            f"for its O_DIRECT read")


def demo_drafters() -> str:
    data = load(BENCH / "cpu" / "demo-drafters.json")
    parts = []
    for drafter, label in (("draft model", "the shipped draft model"), ("ngram", "n-gram")):
        rows = [data["summary"][f"{drafter} @ {size}"] for size in ("100%", "25%")]
        parts.append(f"{label} {rows[0]['mean_speedup']:.2f}× / {rows[1]['mean_speedup']:.2f}× "
                     f"(accept rate {rows[0]['accept_rate']:.2f} / {rows[1]['accept_rate']:.2f})")
    repeats = data.get("repeats", 1)
    runs = f", the median of {repeats} interleaved runs each" if repeats > 1 else ""
    return f"{len(data['prompts'])} held-out prompts{runs}, greedy, at 100 % / 25 % cache: " + "; ".join(parts)



FAMILIES = (("gpt-oss-20b", "family-gpt-oss-20b.json"), ("Qwen3.5-35B-A3B", "family-qwen3.5-35b-a3b.json"),
            ("Gemma 4 26B-A4B", "family-gemma-4-26b-a4b.json"),
            ("DeepSeek-V3's first 5 layers", "family-deepseek-v3-5layers.json"))


def h200_families() -> str:
    """Decode at 100 % and 25 % (uniform routing) of the other families' shapes."""
    parts = []
    for label, name in FAMILIES:
        path = H200 / name
        data = load(path)
        if data.get("routing") != "uniform":
            raise NumbersError(f"{path.relative_to(ROOT)}: routing {data.get('routing')!r}, not uniform")
        full, quarter = run_at(data, "100%", path), run_at(data, "25%", path)
        parts.append(f"{label} {tok_s(full['decode']['tok_s'])} / {tok_s(quarter['decode']['tok_s'])}")
    return ", ".join(parts) + " tok/s"


def h200_cpu_share_device() -> str:
    """The device path's CPU share (auto, and 0: the mailbox alone) at 25 % against no share, this build."""
    auto = only_run(H200 / "device-cpu-share-25pct-uniform-auto-v2.json")
    empty = only_run(H200 / "device-cpu-share-25pct-uniform-0-v2.json")
    off = only_run(H200 / "decode-ahead-off-25pct-uniform.json")
    ex = auto["experts"]
    return (f"{tok_s(auto['decode']['tok_s'])} tok/s with `--cpu-experts auto` and {tok_s(empty['decode']['tok_s'])} "
            f"with a share of 0 at 25 % (hit rate {auto['decode']['hit_rate']:.2f}) against "
            f"{tok_s(off['decode']['tok_s'])} without a share; `auto` measured the worker's kernels at "
            f"{ex['cpu_kernel_gb_s_ema']:.1f} GB/s and its hand-over at {ex['cpu_handover_us_ema']:.0f} µs against "
            f"{ex['copy_gb_s']:.1f} GB/s copies and settled at a share of {ex['cpu_share_now']:.3f}")


def h200_step_rows() -> str:
    """A step's rows at once against row by row, resident, one call: step costs and one-token decode."""
    off, auto = (only_run(H200 / f"step-rows-{m}-resident.json") for m in ("off", "auto"))
    ms = [(r["step_cost"]["step_ms"]) for r in (off, auto)]
    return (f"a 16-token step {ms[0]['16']:.1f} → {ms[1]['16']:.1f} ms, an 8-token step {ms[0]['8']:.1f} → "
            f"{ms[1]['8']:.1f} ms, one-token decode {tok_s(off['decode']['tok_s'])} → {tok_s(auto['decode']['tok_s'])} tok/s")


def h200_demo_drafters() -> str:
    """The demo's n-gram drafter on the H200 at 100 % (plain decoding deciding ahead): each prompt's speedup."""
    path = H200 / "demo-ngram-decode-ahead.json"
    runs = [r for r in load(path)["runs"] if r["drafter"] == "ngram" and r["cache_size"] == "100%"]
    if not runs:
        raise NumbersError(f"{path.relative_to(ROOT)}: no n-gram run at 100%")
    speedups = [r["speedup"] for r in runs]
    return (f"n-gram on {len(runs)} held-out prompts at 100 % cache: " + " / ".join(f"{x:.2f}×" for x in speedups)
            + f" plain decoding (mean {sum(speedups) / len(speedups):.2f}×; both speculative runs of each prompt "
            "against both plain runs)")


def h200_server_batching() -> str:
    """Total tok/s of `serve --parallel 16` at 16 and 32 clients against one request at a time (`--parallel 1`)."""
    path = H200 / "server-batching-100pct-128tok.json"
    data = load(path)
    by = {r["parallel"]: {x["clients"]: x for x in r["rounds"]} for r in data["runs"]}
    one = by.get(1, {}).get(1)
    if one is None or any(c not in by.get(16, {}) for c in (16, 32)):
        raise NumbersError(f"{path.relative_to(ROOT)}: needs --parallel 1 at 1 client and --parallel 16 at 16 and 32")
    rounds = [by[16][c] for c in (16, 32)]
    return (f"{data['settings']['max_tokens']}-token requests: 16 clients {tok_s(rounds[0]['total_tok_s'])} tok/s, "
            f"32 clients {tok_s(rounds[1]['total_tok_s'])}, against {tok_s(one['total_tok_s'])} for one request at a "
            f"time: {rounds[0]['total_tok_s'] / one['total_tok_s']:.2f}× and {rounds[1]['total_tok_s'] / one['total_tok_s']:.2f}× "
            f"(mean batch {rounds[0]['mean_batch_size']:.1f} and {rounds[1]['mean_batch_size']:.1f})")


def h200_prefill() -> str:
    """Resident prefill at every length with the workspace kept (the default), and given back (before), one call."""
    keep, release = (only_run(H200 / f"prefill-workspace-{m}.json") for m in ("keep", "release"))
    lengths = [p["tokens"] for p in keep["prefill"]]
    return (" / ".join(f"{n:,}" for n in lengths) + " tokens: "
            + " / ".join(f"{prefill_tok_s(keep, n):,.0f}" for n in lengths) + " tok/s (given back after each prefill, as "
            "before: " + " / ".join(f"{prefill_tok_s(release, n):,.0f}" for n in lengths) + "); decode "
            + tok_s(keep["decode"]["tok_s"]) + " tok/s")


def prefill_by_length(before: dict, after: dict) -> tuple[list[int], str, str]:
    """The lengths of a run pair's prefills and each run's tok/s at them, "a / b / c"."""
    lengths = [p["tokens"] for p in after["prefill"]]
    return lengths, *(" / ".join(f"{prefill_tok_s(run, n):,.0f}" for n in lengths) for run in (before, after))


def h200_prefill_kernels() -> str:
    """Resident prefill at every length with the attention half on torch ops and on the fused kernels, one call."""
    lengths, torch_ops, fused = prefill_by_length(*(only_run(H200 / f"prefill-kernels-{k}.json")
                                                    for k in ("torch", "fused")))
    return " / ".join(f"{n:,}" for n in lengths) + f" tokens: {torch_ops} → {fused} tok/s"


def h200_decode_ahead() -> str:
    """Resident decode one step at a time against decoding ahead, one call."""
    off, on = (only_run(H200 / f"decode-ahead-{m}-resident.json") for m in ("off", "auto"))
    return f"{tok_s(off['decode']['tok_s'])} → {tok_s(on['decode']['tok_s'])} tok/s"


def h200_prefill_graphs() -> str:
    """Resident prefill, eager against one CUDA graph per length bucket, one call."""
    lengths, eager, graphs = prefill_by_length(*(only_run(H200 / f"prefill-graphs-{m}.json") for m in ("off", "on")))
    return " / ".join(f"{n:,}" for n in lengths) + f" tokens at {graphs} tok/s (eager: {eager})"


def h200_new_defaults() -> str:
    """Resident decode and prefill with the old defaults against the padded prefill's graphs and the Triton row
    products (the defaults since), one call."""
    before, after = (only_run(H200 / f"defaults-{m}.json") for m in ("before-graphs-triton", "graphs-triton"))
    lengths, eager, graphs = prefill_by_length(before, after)
    return (f"decode {tok_s(before['decode']['tok_s'])} → {tok_s(after['decode']['tok_s'])} tok/s; prefill of "
            + " / ".join(f"{n:,}" for n in lengths) + f" tokens {eager} → {graphs} tok/s")


def h200_rows_split() -> str:
    """The row products with K splits and three classes of sizes: kernel times before (old defaults, first
    sweep's table) and after (the new defaults' table), decode in the first sweep's call and the next."""
    before, after = (load(H200 / f"rows-{m}-sweep.json").get("rows_products", {}) for m in ("split", "classes"))
    names = (("router", "the router"), ("o", "o"), ("qkv", "q/k/v"))
    if any(n not in before or n not in after for n, _ in names):
        raise NumbersError("docs/bench/h200/rows-{split,classes}-sweep.json: no rows_products table")
    kernels = ", ".join(f"{label} {before[n]['triton']['us']:.1f} → {after[n]['triton']['us']:.1f} µs" for n, label in names)
    old, swept, now = (only_run(H200 / f"rows-{m}.json") for m in ("split-before", "split-after", "classes-defaults"))
    return (f"{kernels}; resident decode {tok_s(old['decode']['tok_s'])} → {tok_s(swept['decode']['tok_s'])} tok/s "
            f"in one call (the first sweep's sizes), {tok_s(now['decode']['tok_s'])} tok/s with the three classes "
            f"as the defaults (the next call)")


def h200_pdl() -> str:
    """Resident decode without / with / without programmatic dependent launch, one call."""
    runs = [only_run(H200 / f"pdl-{m}.json") for m in ("off", "on", "off-again")]
    return " → ".join(tok_s(r["decode"]["tok_s"]) for r in runs) + " tok/s (without / with / without PDL, one call)"


NATIVE_SHARE = ("policy-auto", "policy-off")  # the latest H200 call's auto and off (25 %)


def h200_native_share() -> str:
    """Streamed decode at 25 % with uniform routing, the native CPU share's worker against no share, one call."""
    auto, off = (only_run(H200 / f"{name}.json") for name in NATIVE_SHARE)
    d = auto["decode"]
    return (f"{tok_s(d['tok_s'])} tok/s with `--cpu-experts auto` against {tok_s(off['decode']['tok_s'])} without "
            f"(hit rate {d['hit_rate']:.2f}); the worker's kernels {d['cpu_kernel_gb_s']:.1f} GB/s on "
            f"{d['cpu_worker_threads']} threads, its hand-over {d['cpu_handover_us_ema']:.1f} µs, the share settled at "
            f"{d['cpu_share_now']:.2f} of the misses")


def h200_share_sizes() -> str:
    """Streamed decode with uniform routing at 10 / 25 / 50 %, the CPU share (`auto`) and none, one call."""
    auto = {size: only_run(H200 / f"policy-auto{suffix}.json")["decode"] for size, suffix in SIZES}
    off = {size: only_run(H200 / f"policy-off{suffix}.json")["decode"] for size, suffix in SIZES}
    parts = [f"{size} %: {tok_s(a['tok_s'])} tok/s (hit rate {a['hit_rate']:.2f}, share {a['cpu_share_now']:.2f}, "
             f"kernels {a['cpu_kernel_gb_s']:.1f} GB/s)" for size, a in auto.items()]
    return ("; ".join(parts) + ". Without a share, same call: "
            + " / ".join(tok_s(b["tok_s"]) for b in off.values()) + " tok/s at 10 / 25 / 50 %")


def h200_cycle_policy() -> str:
    """The device map's victim rule at 25 % uniform: cycle against lru without a share (two runs each, one
    call), with the share (A-B-A-B, the call before), and under an 8 GiB budget (that call)."""
    def runs(*names: str) -> list[dict]:
        return [only_run(H200 / f"{name}.json")["decode"] for name in names]

    def series(found: list[dict]) -> str:
        return " / ".join(tok_s(d["tok_s"]) for d in found)

    cycle_off, lru_off = runs("policy3-off", "policy3-off2"), runs("policy3-off-lru", "policy3-off-lru2")
    cycle_auto, lru_auto = runs("policy2-auto", "policy2-auto2"), runs("policy2-auto-lru", "policy2-auto-lru2")
    budget_auto, budget_off = (only_run(H200 / f"policy2-budget-{m}.json") for m in ("auto", "off"))
    reserved = budget_auto["device_memory"]["max_reserved"] / 2**30
    return (f"without a share the cycle rule {series(cycle_off)} tok/s (hit rate {cycle_off[0]['hit_rate']:.2f}) "
            f"against LRU's {series(lru_off)} ({lru_off[0]['hit_rate']:.2f}); with `--cpu-experts auto` "
            f"{series(cycle_auto)} against {series(lru_auto)}; under `--memory-budget 8GiB` ({budget_auto['slots']:,} "
            f"slots, {reserved:.2f} GiB reserved) {tok_s(budget_auto['decode']['tok_s'])} tok/s with the share and "
            f"{tok_s(budget_off['decode']['tok_s'])} without")


SIZES = (("10", "-10"), ("25", ""), ("50", "-50"))


def h200_slot_map_cost() -> str:
    """One device-map lookup per victim rule and cache size (scripts/bench_slot_map.py)."""
    path = H200 / "slot-map.json"
    cells = {(c["policy"], c["cache"]): c for c in load(path)["cells"]}
    sizes = sorted({size for _, size in cells})
    if any((rule, size) not in cells for rule in ("cycle", "lru") for size in sizes):
        raise NumbersError(f"{path.relative_to(ROOT)}: a cell is missing")

    def row(rule: str, key: str, form: str) -> str:
        return " / ".join(format(cells[rule, size][key], form) for size in sizes)

    return (f"at {' / '.join(f'{size * 100:.0f}' for size in sizes)} % of the experts the cycle rule takes "
            f"{row('cycle', 'us_per_lookup', '.1f')} µs a lookup, LRU {row('lru', 'us_per_lookup', '.1f')} (hit "
            f"rates {row('cycle', 'hit_rate', '.2f')} against {row('lru', 'hit_rate', '.2f')})")


def h200_grouped() -> str:
    """The grouped (prefill) kernels before and after the sweep, uniform routing, from one sweep."""
    path = H200 / "grouped-kernels-sweep.json"
    sweep = load(path).get("sweep", {})
    parts = []
    for tokens in (512, 2048):
        found = sweep.get(f"4bit_T{tokens}", {}).get("grouped")
        if not found or not found.get("current") or not found.get("best"):
            raise NumbersError(f"{path.relative_to(ROOT)}: no grouped sweep at {tokens} tokens")
        before, after = found["current"]["uniform_ms"] * 1e3, found["best"]["uniform_ms"] * 1e3
        parts.append(f"{tokens:,} tokens {before:,.0f} → {after:,.0f} µs ({before / after:.1f}×)")
    return "; ".join(parts)


BLOCKS: dict[str, Callable[[], str]] = {
    "demo-drafters": demo_drafters,
    "demo-cache-sweep": demo_cache_sweep,
    "h200-q30-cache-sizes": h200_q30_cache_sizes,
    "h200-uniform": h200_uniform,
    "h200-device-uniform": h200_device_uniform,
    "h200-device-25": h200_device_25,
    "h200-slot-map": h200_slot_map,
    "h200-decoder-ab": h200_decoder_ab,
    "h200-gemv-tuned": h200_gemv_tuned,
    "h200-vs-transformers": h200_vs_transformers,
    "h200-4layers-25": h200_4layers_25,
    "synth-hit-25": synth_hit_25,
    "crc32-cost": crc32_cost,
    "h200-families": h200_families,
    "h200-cpu-share-device": h200_cpu_share_device,
    "h200-server-batching": h200_server_batching,
    "h200-step-rows": h200_step_rows,
    "h200-demo-drafters": h200_demo_drafters,
    "h200-prefill": h200_prefill,
    "h200-prefill-kernels": h200_prefill_kernels,
    "h200-decode-ahead": h200_decode_ahead,
    "h200-prefill-graphs": h200_prefill_graphs,
    "h200-new-defaults": h200_new_defaults,
    "h200-rows-split": h200_rows_split,
    "h200-pdl": h200_pdl,
    "h200-native-share": h200_native_share,
    "h200-share-sizes": h200_share_sizes,
    "h200-cycle-policy": h200_cycle_policy,
    "h200-slot-map-cost": h200_slot_map_cost,
    "h200-grouped": h200_grouped,
}


# --- the README ---------------------------------------------------------------------------------


def render(readme: str) -> tuple[str, list[str]]:
    """(README with every block rendered from the JSON, names of the blocks that changed)."""
    begins = len(BEGIN.findall(readme))
    matches = list(MARKER.finditer(readme))
    if begins != len(matches) or readme.count(END) != len(matches):
        raise NumbersError(f"unbalanced numbers markers: {begins} begin, {readme.count(END)} end, {len(matches)} pairs")
    seen = [m.group(1) for m in matches]
    unknown = sorted(set(seen) - BLOCKS.keys())
    if unknown:
        raise NumbersError(f"unknown numbers block(s): {', '.join(unknown)} (known: {', '.join(BLOCKS)})")
    twice = sorted({n for n in seen if seen.count(n) > 1})
    if twice:
        raise NumbersError(f"numbers block(s) more than once: {', '.join(twice)}")
    absent = [n for n in BLOCKS if n not in seen]
    if absent:
        raise NumbersError(f"numbers block(s) missing from the README: {', '.join(absent)}")

    changed: list[str] = []

    def replace(m: re.Match) -> str:
        name, old = m.group(1), m.group(2)
        text = BLOCKS[name]()
        if old.startswith("\n"):
            # blank lines around the lines, so the markers never join a paragraph or a table
            new = f"\n\n{text}\n\n"
        else:
            line_start = readme.rfind("\n", 0, m.start()) + 1
            if not readme[line_start:m.start()].strip():
                # markdown reads a line that begins with "<!--" as raw HTML, and would show the text raw
                raise NumbersError(f"inline numbers block '{name}' begins a line: put a word before it")
            new = text
        if new != old:
            changed.append(name)
        return f"<!-- numbers:begin {name} -->{new}{END}"

    return MARKER.sub(replace, readme), changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a block differs from the JSON; change nothing")
    parser.add_argument("--readme", type=Path, default=ROOT / "README.md", help="the file to render (default README.md)")
    args = parser.parse_args(argv)
    try:
        try:
            readme = args.readme.read_text(encoding="utf-8")
        except OSError as exc:
            raise NumbersError(f"{args.readme}: cannot read ({exc.strerror})") from None
        new, changed = render(readme)
    except (NumbersError, KeyError, ValueError) as exc:
        detail = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
        print(f"readme_numbers: {detail}", file=sys.stderr)
        return 2
    if args.check:
        for name in changed:
            print(f"{args.readme.name}: block '{name}' differs from the JSON "
                  f"(run python scripts/readme_numbers.py)", file=sys.stderr)
        return 1 if changed else 0
    if changed:
        args.readme.write_text(new, encoding="utf-8")
        print(f"rewrote {', '.join(changed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
