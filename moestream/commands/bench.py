"""`moestream bench --model DIR`: prefill and decode speed, hit rate and read bandwidth per tier,
over one or several cache sizes, as JSON with the machine and the exact command (moestream.bench.main
measures)."""
from __future__ import annotations

import argparse
import json
import logging
import sys
import threading
from dataclasses import replace
from pathlib import Path

import torch
from tqdm import tqdm

from moestream.bench.heatmap import ReportError, plot_heatmap
from moestream.bench.machine import machine_info
from moestream.bench.main import (compare_transformers, drop_page_cache, measure, parse_lengths, parse_step_tokens,
                                  plot, random_prompt)
from moestream.bench.routing import parse_routing
from moestream.commands.args import Parser, check_output_paths, fail
from moestream.commands.engine_args import (add_engine_arguments, check_engine_args, digest_dir, options_from_args,
                                            size_problem)
from moestream.commands.speculative_flags import (add_speculative_arguments, check_speculative_args, speculating,
                                                  speculative_options)
from moestream.engine import timeline
from moestream.errors import MoestreamError
from moestream.flag_values import at_least

log = logging.getLogger(__name__)
DEFAULT_PREFILL = "512,2048"


class Phases:
    """A progress line on stderr: `with Phases("bench", enabled=...) as show: show("load"); ...` shows the
    phase now running and the time spent in it, redrawn every second, so a phase that takes minutes
    never leaves the terminal silent."""

    def __init__(self, label: str, *, enabled: bool = True, refresh_s: float = 1.0) -> None:
        self.label, self.enabled, self.refresh_s = label, enabled, refresh_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._redraw, name="progress", daemon=True)

    def __enter__(self) -> "Phases":
        self._bar = tqdm(total=None, desc=self.label, file=sys.stderr, bar_format="{desc} {elapsed}", leave=False,
                         disable=not self.enabled)
        if self.enabled:
            self._thread.start()
        return self

    def __call__(self, phase: str) -> None:
        self._bar.set_description_str(f"{self.label}: {phase}")

    def _redraw(self) -> None:
        while not self._stop.wait(self.refresh_s):
            self._bar.refresh()

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self.enabled:
            self._thread.join()
        self._bar.close()


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream bench", description="Benchmark prefill, decode and expert streaming.")
    p.add_argument("--model", help="packed model directory (default: the built-in demo model)")
    p.add_argument("--cache-sizes", default=None, help="comma-separated cache sizes to sweep, e.g. 10%%,25%%,50%%,100%% "
                                                      "(default: --cache-size)")
    p.add_argument("--prefill-tokens", default=None, metavar="N,N,...",
                   help=f"prompt lengths to time (default {DEFAULT_PREFILL}, those of them the context holds)")
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
    p.add_argument("--seed", type=at_least(0), default=0, metavar="N", help="seed of the random prompts (default 0)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
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


def prefill_lengths(parser: argparse.ArgumentParser, args, context: int | None) -> list[int]:
    """--prefill-tokens as lengths. One the context cannot hold (measure() times a prefill of N tokens
    where N + 1 < the context) is refused (exit 2); without the flag, default lengths it cannot hold
    are left out with a note."""
    try:
        lengths = parse_lengths(DEFAULT_PREFILL if args.prefill_tokens is None else args.prefill_tokens)
    except MoestreamError as exc:
        parser.error(f"argument {exc}")
    if context is None:
        return lengths
    too_long = [n for n in lengths if n + 1 >= context]
    if too_long and args.prefill_tokens is not None:
        parser.error(f"argument --prefill-tokens: {too_long[0]} tokens do not fit the context of {context} tokens "
                     f"(at most {context - 2}; --max-context sets the context)")
    if too_long:
        print(f"moestream bench: the context holds {context} tokens: prefill lengths {', '.join(map(str, too_long))} "
              f"left out", file=sys.stderr)
    return [n for n in lengths if n not in too_long]


def run(args, parser: argparse.ArgumentParser) -> dict:
    from moestream.engine.engine import load_engine
    from moestream.engine.plan import run_facts

    from moestream.bench.routing import rerouter

    base = options_from_args(args)
    routing = parse_routing(args.routing)
    sizes = [x.strip() for x in args.cache_sizes.split(",") if x.strip()] if args.cache_sizes else [base.cache_size]
    step_sizes = parse_step_tokens(args.step_tokens) if args.step_tokens else []
    from moestream.engine.engine import DEMO_MODEL
    from moestream.engine.plan import plan_run
    from moestream.format.reader import PackedModel

    context = None
    if args.model or (DEMO_MODEL / "moestream.json").is_file():
        packed = PackedModel(args.model or DEMO_MODEL)
        for size in sizes:  # a bad size is named now, not after the sizes before it have run
            context = plan_run(packed, replace(base, cache_size=size), digest_dir=digest_dir()).max_context
    prefill_sizes = prefill_lengths(parser, args, context)
    if args.compare_transformers and not prefill_sizes:
        parser.error("argument --compare-transformers: needs at least one --prefill-tokens length")
    results = {"machine": machine_info(), "model": str(args.model or "demo"), **routing.to_json(), "runs": []}
    for size in sizes:
        if args.cold and not drop_page_cache():
            log.warning("could not drop the page cache (not root?); reads may come from RAM")
        if torch.cuda.is_available():  # each run's peak is its own
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        with Phases(f"bench, cache {size}", enabled=not args.no_progress) as show:
            show("load")
            engine = load_engine(args.model, replace(base, cache_size=size), digest_dir=digest_dir(),
                                 reroute=rerouter(routing, seed=args.seed))
            speculative = None
            try:
                speculative = speculative_options(args, engine) if speculating(args) else None
                prompt = engine.tokenizer.encode(args.prompt) if args.prompt is not None else None
                if args.warmup:  # the host tier filled with every record it can hold, a long prefill, a short decode
                    show("warmup")
                    engine.provider.fill_host_tier()
                    vocab = engine.args.vocab_size
                    engine.prefill(random_prompt(min(2048, engine.max_context - 1), vocab, args.seed + 1))
                    for n in prefill_sizes:  # each measured length once: its kernel tiles compile here, not in the timing
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
                                       prompt=prompt, speculative=speculative, on_phase=show)
                run_result = {"cache_size": size, "slots": engine.plan.slots, "total_experts": engine.plan.total_experts,
                              "streaming": engine.streaming, **run_facts(engine.options), **measured}
                if step_sizes:
                    from moestream.bench.step_cost import measure_step_costs

                    show("step costs")
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

        with Phases("bench: transformers", enabled=not args.no_progress):
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
    check_engine_args(parser, args)
    for value, parse in ((args.step_tokens, parse_step_tokens), (args.routing, parse_routing)):
        try:
            value is None or parse(value)
        except MoestreamError as exc:
            parser.error(f"argument {exc}")
    for size in (args.cache_sizes or "").split(","):
        problem = size.strip() and size_problem(size)
        if problem:
            parser.error(f"argument --cache-sizes: {problem}")
    check_speculative_args(parser, args, sampling=None, model_dir=args.model)  # bench decodes greedily
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        results = run(args, parser)
    except MoestreamError as exc:
        return fail("moestream bench", str(exc))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    if args.heatmap:
        try:
            plot_heatmap(results, args.heatmap, title=f"{results['model']}: expert hit rate per layer")
        except ReportError as exc:
            return fail("moestream bench", f"--heatmap: the results {exc}")
    return 0
