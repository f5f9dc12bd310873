"""`moestream bench --model DIR`: prefill and decode speed, hit rate and read bandwidth per tier,
over one or several cache sizes, as JSON with the machine and the exact command."""
from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from moestream.bench.machine import machine_info
from moestream.cli_args import Parser, at_least, check_output_paths
from moestream.engine import timeline
from moestream.engine.options import EngineOptions, add_engine_arguments
from moestream.engine.speculative_flags import (add_speculative_arguments, check_speculative_args, speculating,
                                                speculative_options)
from moestream.errors import MoestreamError

log = logging.getLogger(__name__)


def drop_page_cache() -> bool:
    """Empty the OS page cache so expert reads come from the disk (needs root)."""
    try:
        subprocess.run(["sync"], check=False)
        with open("/proc/sys/vm/drop_caches", "w") as fh:
            fh.write("3\n")
        return True
    except OSError:
        return False


def random_prompt(n: int, vocab: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def parse_lengths(text: str) -> list[int]:
    """"512,2048" -> [512, 2048]; a clear error for anything that is not a positive integer."""
    lengths = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if not part.isdigit() or int(part) < 1:
            raise MoestreamError(f"--prefill-tokens: {part!r} is not a positive number of tokens")
        lengths.append(int(part))
    return lengths


def decode_run(engine, prompt: list[int], tokens: int, speculative=None) -> tuple[dict, list[int]]:
    """One decode of `tokens` tokens from `prompt` (prefilled whole): its receipt and tokens."""
    engine.reset()
    gen = engine.generate(prompt, max_new_tokens=tokens, stop_at_eos=False, speculative=speculative)
    ids = [event.token_id for event in gen]
    return gen.result.receipt, ids


def measure_speculative(engine, prompt: list[int], tokens: int, speculative, plain: tuple[dict, list[int]]) -> dict:
    """Decode speed with and without speculation on one prompt, in the order plain (already run:
    `plain`), speculative, speculative, plain: a drift in the machine's speed (caches warming,
    other load) weighs on both sides alike. Each side's tok/s is the mean of its two runs."""
    runs = {"plain": [plain], "speculative": []}
    runs["speculative"].append(decode_run(engine, prompt, tokens, speculative))
    runs["speculative"].append(decode_run(engine, prompt, tokens, speculative))
    runs["plain"].append(decode_run(engine, prompt, tokens))
    rates = {side: [r["decode_tok_s"] or 0.0 for r, _ in pair] for side, pair in runs.items()}
    mean = {side: sum(v) / len(v) for side, v in rates.items()}
    specs = [r["speculative"] for r, _ in runs["speculative"]]
    drafted, accepted = sum(s["drafted"] for s in specs), sum(s["accepted"] for s in specs)
    steps, step_tokens = sum(s["verify_steps"] for s in specs), sum(r["generated_tokens"] for r, _ in runs["speculative"])
    return {"drafter": specs[0]["drafter"], "draft_tokens": specs[0]["draft_tokens"],
            "order": ["plain", "speculative", "speculative", "plain"],
            "plain_tok_s": rates["plain"], "speculative_tok_s": rates["speculative"],
            "plain_mean_tok_s": round(mean["plain"], 2), "speculative_mean_tok_s": round(mean["speculative"], 2),
            "speedup": round(mean["speculative"] / mean["plain"], 3) if mean["plain"] else None,
            # the first token comes from the prefill; each verification step yields the rest
            "tokens_per_step": round((step_tokens - len(specs)) / steps, 3) if steps else None,
            "accept_rate": round(accepted / drafted, 4) if drafted else None, "drafted": drafted, "accepted": accepted,
            "hit_rate": {"plain": [r["hit_rate"] for r, _ in runs["plain"]],
                         "speculative": [r["hit_rate"] for r, _ in runs["speculative"]]},
            "same_tokens": len({tuple(ids) for pair in runs.values() for _, ids in pair}) == 1,
            "receipt": specs[-1]}


def parse_step_tokens(text: str) -> list[int]:
    """--step-tokens: comma-separated token counts of 1..16 (a step's most)."""
    from moestream.engine.decoder import MAX_STEP_TOKENS

    out = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit() or not 1 <= int(part) <= MAX_STEP_TOKENS:
            raise MoestreamError(f"--step-tokens: {part!r} is not a token count of 1..{MAX_STEP_TOKENS}")
        out.append(int(part))
    return sorted(set(out))


def measure(engine, *, prefill_sizes: list[int], decode_tokens: int, seed: int, prompt: list[int] | None = None,
            speculative=None, prefill_repeats: int = 1) -> dict:
    vocab = engine.args.vocab_size
    out = {"prefill": []}
    for n in prefill_sizes:
        if n + 1 >= engine.max_context:
            continue
        times, before = [], engine.expert_stats()
        # with repeats, one run first that is not counted: a prefill graph's bucket is captured at its
        # second prompt, so the counted runs are the capture and replays (their median a replay)
        for _ in range(prefill_repeats + (prefill_repeats > 1)):  # the same prompt each time, from an empty cache
            engine.reset()
            t0 = time.perf_counter()
            engine.prefill(random_prompt(n, vocab, seed + n))
            engine._sync()
            times.append(time.perf_counter() - t0)
        after = engine.expert_stats()
        first, times = times[0], times[-prefill_repeats:]
        dt = statistics.median(times)
        out["prefill"].append({"tokens": n, "s": round(dt, 4), "tok_s": round(n / dt, 2),
                               "hit_rate": _hit_rate(before, after),
                               **({"runs_s": [round(t, 4) for t in times], "first_s": round(first, 4)}
                                  if prefill_repeats > 1 else {})})
    engine.reset()
    cuda = engine.device.type == "cuda"
    if cuda:
        run_peak = torch.cuda.max_memory_reserved(engine.device)
        engine.release_workspace()
        torch.cuda.reset_peak_memory_stats(engine.device)
    decode_start = engine.expert_stats()
    prompt = prompt or random_prompt(16, vocab, seed)
    plain = decode_run(engine, prompt, decode_tokens)
    r = plain[0]
    decode_end = engine.expert_stats()
    host_gb_s = r["bytes_read_host"] / r["read_wait_s"] / 1e9 if r["read_wait_s"] > 0 else None
    out["decode"] = {"tokens": r["generated_tokens"], "s": r["decode_s"], "tok_s": r["decode_tok_s"],
                     "hit_rate": r["hit_rate"], "misses": r["misses"], "bytes_read_disk": r["bytes_read_disk"],
                     "bytes_read_host": r["bytes_read_host"], "read_wait_s": r["read_wait_s"],
                     "disk_gb_s_while_waiting": round(r["bytes_read_disk"] / r["read_wait_s"] / 1e9, 3) if r["read_wait_s"] > 0 else None,
                     "host_gb_s_while_waiting": round(host_gb_s, 3) if host_gb_s else None}
    if "cpu_share" in decode_end:  # --cpu-experts: what the CPU computed during the decode
        out["decode"].update({k: decode_end[k] - decode_start[k] for k in (
            "cpu_experts", "cpu_fallbacks", "cpu_timeouts", "cpu_repacks", "cpu_skipped_busy", "cpu_not_repacked")})
        out["decode"]["cpu_wait_s"] = round(decode_end["cpu_wait_s"] - decode_start["cpu_wait_s"], 6)
        out["decode"].update({k: decode_end[k] for k in (
            "cpu_share", "cpu_gb_s_ema", "copy_gb_s_ema", "cpu_repacked_experts", "cpu_repacked_bytes",
            "cpu_repack_wall_s", "cpu_repack_workers", "cpu_repack_left_out")})
        if decode_end.get("cpu_share_path") == "device":  # the mailbox's calls and auto's figures at the end
            out["decode"].update({k: decode_end[k] - decode_start[k] for k in (
                "cpu_jobs", "cpu_empty_calls", "cpu_late_calls", "cpu_pairs", "cpu_errors", "cpu_bytes")})
            kernel_s = decode_end["cpu_compute_s"] - decode_start["cpu_compute_s"]
            out["decode"]["cpu_kernel_gb_s"] = round(out["decode"]["cpu_bytes"] / kernel_s / 1e9, 3) if kernel_s > 0 else None
            out["decode"].update({k: decode_end[k] for k in (
                "cpu_worker", "cpu_worker_threads", "cpu_worker_team", "cpu_worker_activations", "cpu_share_now", "cpu_kernel_gb_s_ema", "cpu_handover_us_ema",
                "cpu_misses_per_job_ema", "copy_gb_s", "copy_gb_s_timed")})
    if speculative is not None:
        out["speculative"] = measure_speculative(engine, prompt, decode_tokens, speculative, plain)
    out["experts"] = engine.expert_stats()
    if cuda:  # what the run really held (prefills included), and what the decode alone held
        decode_peak = torch.cuda.max_memory_reserved(engine.device)
        out["device_memory"] = {"max_reserved": max(run_peak, decode_peak), "decode_max_reserved": decode_peak,
                                "decode_max_allocated": torch.cuda.max_memory_allocated(engine.device)}
    out["memory"] = engine.memory_ledger()
    return out


def _hit_rate(before: dict, after: dict) -> float:
    hits = after.get("hits", 0) - before.get("hits", 0)
    misses = after.get("misses", 0) - before.get("misses", 0)
    return round(hits / (hits + misses), 4) if hits + misses else 1.0


def compare_transformers(model_dir: str, *, device: str, prefill: int, decode_tokens: int, seed: int) -> dict:
    """The same (dequantized) weights through transformers, bf16, everything on the device."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from moestream.convert.export_hf import export_hf

    with tempfile.TemporaryDirectory() as tmp:
        export_hf(model_dir, tmp, dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to(device).eval()
    vocab = model.config.vocab_size
    ids = torch.tensor([random_prompt(prefill, vocab, seed)], device=device)
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    with torch.inference_mode():
        model(ids[:, :8])
        sync()
        t0 = time.perf_counter()
        model(ids)
        sync()
        prefill_s = time.perf_counter() - t0
        short = torch.tensor([random_prompt(16, vocab, seed)], device=device)
        t0 = time.perf_counter()
        model.generate(short, max_new_tokens=decode_tokens, min_new_tokens=decode_tokens, do_sample=False)
        sync()
        decode_s = time.perf_counter() - t0
    return {"prefill_tokens": prefill, "prefill_tok_s": round(prefill / prefill_s, 2),
            "decode_tokens": decode_tokens, "decode_tok_s": round(decode_tokens / decode_s, 2)}


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = results["runs"]
    labels = [r["cache_size"] for r in runs]
    fig, ax1 = plt.subplots(figsize=(6, 3.5))
    ax1.bar(labels, [r["decode"]["tok_s"] or 0 for r in runs], color="#4C72B0")
    ax1.set_xlabel("device expert cache")
    ax1.set_ylabel("decode tok/s")
    ax2 = ax1.twinx()
    ax2.plot(labels, [r["decode"]["hit_rate"] for r in runs], "o-", color="#DD8452")
    ax2.set_ylabel("expert hit rate")
    ax2.set_ylim(0, 1.05)
    ax1.set_title(f"{results['model']} on {results['machine'].get('gpu') or results['machine']['cpu']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream bench", description="Benchmark prefill, decode and expert streaming.")
    p.add_argument("--model", help="packed model directory (default: the built-in demo model)")
    p.add_argument("--cache-sizes", default=None, help="comma-separated cache sizes to sweep, e.g. 10%%,25%%,50%%,100%% "
                                                      "(default: --cache-size)")
    p.add_argument("--prefill-tokens", default="512,2048", help="prompt lengths to time (default 512,2048)")
    p.add_argument("--prefill-repeats", type=at_least(1), default=1, metavar="N",
                   help="time each prompt length N times and report the median (each run listed in the JSON; "
                        "a single prefill call varies by up to ~15 %% on the H200); N > 1 runs one more first, not "
                        "counted (its time is first_s): a prefill graph's bucket is captured at its second prompt")
    p.add_argument("--decode-tokens", type=at_least(1), default=128, help="tokens to decode (default 128)")
    p.add_argument("--prompt", default=None,
                   help="decode after this text (default: 16 random tokens); speculation gains where the text repeats")
    p.add_argument("--cold", action="store_true", help="drop the OS page cache before each run (needs root)")
    p.add_argument("--warmup", action="store_true",
                   help="first fill the host tier (every record it can hold), prefill 2048 tokens and each measured length, "
                        "decode 32 (and prefill 2048 on a draft model): caches start warm and kernels are compiled")
    p.add_argument("--compare-transformers", action="store_true", help="also run the same weights through transformers (bf16, all on the device)")
    p.add_argument("--routing", default="model", metavar="KIND",
                   help="model (the router's choice, default), uniform, zipf:S[:L] or trace:FILE: replace the chosen "
                        "experts after each router so streamed speed is measured at a known hit rate "
                        "(random weights collapse onto a few experts); see moestream/bench/routing.py")
    p.add_argument("--step-tokens", default=None, metavar="T,T,...",
                   help="also time verification steps of these token counts (e.g. 1,2,4,8,16) after a short prompt, "
                        "and predict speculation's speedup from them at acceptance 0.5-0.9 (the JSON's step_cost)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="write the JSON results to this file")
    p.add_argument("--plot", default=None, help="write a PNG of decode tok/s and hit rate per cache size")
    p.add_argument("--heatmap", default=None, metavar="FILE.png",
                   help="write a PNG of the hit rate per MoE layer, one row per cache size")
    p.add_argument("--timeline", default=None, metavar="FILE.json",
                   help="write a Chrome/Perfetto trace of the measured prefills and decode (one file per cache size "
                        "in a sweep: FILE-SIZE.json)")
    add_speculative_arguments(p)
    p.set_defaults(draft=("off", None))  # bench times plain decoding unless a drafter is asked for
    add_engine_arguments(p)
    return p


def timeline_path(path: str | None, size: str, sizes: int) -> str | None:
    """FILE.json for one cache size; FILE-SIZE.json for each size of a sweep."""
    if path is None or sizes == 1:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{size}{p.suffix}"))


def run(args) -> dict:
    from moestream.engine.plan import load_engine, run_facts

    from moestream.bench.routing import attach as attach_routing, parse_routing

    base = EngineOptions.from_args(args)
    routing = parse_routing(args.routing)
    sizes = [x.strip() for x in args.cache_sizes.split(",") if x.strip()] if args.cache_sizes else [base.cache_size]
    prefill_sizes = parse_lengths(args.prefill_tokens)
    step_sizes = parse_step_tokens(args.step_tokens) if args.step_tokens else []
    if args.compare_transformers and not prefill_sizes:
        raise MoestreamError("--compare-transformers needs at least one --prefill-tokens length")
    from moestream.engine.engine import DEMO_MODEL
    from moestream.engine.plan import plan_run
    from moestream.format.reader import PackedModel

    if args.model or (DEMO_MODEL / "moestream.json").is_file():
        packed = PackedModel(args.model or DEMO_MODEL)
        for size in sizes:  # a bad size is named now, not after the sizes before it have run
            plan_run(packed, replace(base, cache_size=size))
    results = {"machine": machine_info(), "model": str(args.model or "demo"), **routing.to_json(), "runs": []}
    for size in sizes:
        if args.cold and not drop_page_cache():
            log.warning("could not drop the page cache (not root?); reads may come from RAM")
        if torch.cuda.is_available():  # each run's peak is its own
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        engine = load_engine(args.model, replace(base, cache_size=size))
        speculative = None
        try:
            speculative = speculative_options(args, engine) if speculating(args) else None
            prompt = engine.tokenizer.encode(args.prompt) if args.prompt is not None else None
            attach_routing(engine, routing, seed=args.seed)
            if args.warmup:  # the host tier filled with every record it can hold, a long prefill, a short decode
                engine.provider.fill_host_tier()
                vocab = engine.args.vocab_size
                engine.prefill(random_prompt(min(2048, engine.max_context - 1), vocab, args.seed + 1))
                for n in prefill_sizes:  # each measured length once: its kernel tiles compile here, not in the timing
                    if n + 1 < engine.max_context:
                        engine.reset()
                        engine.prefill(random_prompt(n, vocab, args.seed + 2))
                for _ in engine.generate(random_prompt(32, engine.args.vocab_size, args.seed + 1), max_new_tokens=32,
                                         stop_at_eos=False):
                    pass
                if speculative is not None:  # steps of every length a verification or a draft prompt takes
                    from moestream.engine.decoder import MAX_STEP_TOKENS

                    draft_engine = getattr(speculative.drafter, "engine", None)
                    if draft_engine is not None:  # its prefill's kernels, first used by a probe's catch-up
                        draft_engine.prefill(random_prompt(min(2048, draft_engine.max_context - 1), vocab,
                                                           args.seed + 1))
                        speculative.drafter.probe_price_s  # timed once here (the policy's first price), not in a run
                    for e in (engine, draft_engine):
                        if e is not None:
                            e.reset()
                            e.warm_steps(MAX_STEP_TOKENS)
            with timeline.recording(timeline_path(args.timeline, size, len(sizes)), device=engine.device):
                measured = measure(engine, prefill_sizes=prefill_sizes, decode_tokens=args.decode_tokens, seed=args.seed,
                                   prefill_repeats=args.prefill_repeats,
                                   prompt=prompt, speculative=speculative)
            run_result = {"cache_size": size, "slots": engine.plan.slots, "total_experts": engine.plan.total_experts,
                          "streaming": engine.streaming, **run_facts(engine.options), **measured}
            if step_sizes:
                from moestream.bench.step_cost import measure_step_costs

                run_result["step_cost"] = measure_step_costs(engine, step_sizes, seed=args.seed)
        finally:
            if speculative is not None and speculative.drafter is not None:
                speculative.drafter.close()
            engine.close()
            del engine
        results["runs"].append(run_result)
        if args.out:  # each size as it finishes: a run cut short (a time limit) keeps what it measured
            Path(args.out).write_text(json.dumps({**results, "partial": True}, indent=1))
        d = run_result["decode"]
        pf = ", ".join(f"prefill {p['tokens']}: {p['tok_s']:.0f} tok/s" for p in run_result["prefill"])
        print(f"cache {size:>6} ({run_result['slots']}/{run_result['total_experts']} slots): decode {d['tok_s']} tok/s, "
              f"hit rate {d['hit_rate']:.3f}, read wait {d['read_wait_s']:.2f} s; {pf}", flush=True)
        if "step_cost" in run_result:
            sc = run_result["step_cost"]
            print("  step ms by tokens: " + ", ".join(f"{t}: {ms}" for t, ms in sc["step_ms"].items())
                  + "; predicted speedup at acceptance " + ", ".join(f"{p['acceptance']}: {p['speedup']}x (k={p['best_draft']})"
                                                                 for p in sc["predicted"]), flush=True)
        if "speculative" in run_result:
            sp = run_result["speculative"]
            print(f"  speculative {sp['drafter']} ({sp['draft_tokens']}): {sp['speculative_mean_tok_s']} tok/s against "
                  f"plain {sp['plain_mean_tok_s']} ({sp['speedup']}x), {sp['tokens_per_step']} tok/step, accept rate "
                  f"{sp['accept_rate']}, same tokens: {sp['same_tokens']}", flush=True)
    if args.compare_transformers:
        device = base.device if base.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        from moestream.engine.engine import DEMO_MODEL

        ref = compare_transformers(args.model or DEMO_MODEL, device=device, prefill=max(prefill_sizes),
                                   decode_tokens=args.decode_tokens, seed=args.seed)
        results["transformers"] = ref
        last = results["runs"][-1]
        ref["decode_ratio"] = round((last["decode"]["tok_s"] or 0) / ref["decode_tok_s"], 3)
        print(f"transformers: decode {ref['decode_tok_s']} tok/s, prefill {ref['prefill_tok_s']} tok/s; "
              f"moestream / transformers decode = {ref['decode_ratio']}")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_paths(parser, args, {"out": "--out", "plot": "--plot", "heatmap": "--heatmap", "trace_routing": "--trace-routing",
                                      "timeline": "--timeline"})
    check_speculative_args(parser, args, sampling=None, model_dir=args.model)  # bench decodes greedily
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        results = run(args)
    except MoestreamError as exc:
        print(f"moestream bench: error: {exc}", file=sys.stderr)
        return 1
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot or args.heatmap:
        try:
            if args.plot:
                plot(results, args.plot)
            if args.heatmap:
                from moestream.bench.heatmap import ReportError, plot_heatmap
                try:
                    plot_heatmap(results, args.heatmap, title=f"{results['model']}: expert hit rate per layer")
                except ReportError as exc:
                    print(f"moestream bench: error: --heatmap: the results {exc}", file=sys.stderr)
                    return 1
        except ImportError:
            print("moestream bench: error: --plot needs matplotlib (pip install matplotlib); the JSON was written",
                  file=sys.stderr)
            return 1
    return 0
