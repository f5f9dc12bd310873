"""`moestream generate`: run a packed model on a prompt, streaming text, then a stats line."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from moestream.cli_args import (Parser, at_least, check_output_paths, non_negative_float, probability_mass,
                                unit_interval)
from moestream.engine.detok import IncrementalDecoder
from moestream.engine.options import EngineOptions, add_engine_arguments
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream generate", description="Generate text with a packed MoE model.")
    p.add_argument("--model", help="packed model directory (default: the built-in demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="raw prompt text")
    src.add_argument("--chat-prompt", help="a user message, wrapped in the model's chat template")
    src.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=at_least(1), default=128, help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0 is greedy (default 0)")
    p.add_argument("--top-k", type=at_least(0), default=0, help="sample among the k most likely (0: off)")
    p.add_argument("--top-p", type=probability_mass, default=1.0, help="nucleus sampling mass, in (0, 1] (1: off)")
    p.add_argument("--min-p", type=unit_interval, default=0.0, help="drop tokens below min-p x the top probability (0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, help="transformers-style repetition penalty (1: off)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed: the same seed gives the same text")
    p.add_argument("--logprobs", type=at_least(0), default=0, metavar="N", help="report the top N logprobs of every generated token")
    p.add_argument("--json", action="store_true", help="print one JSON object (token_ids, text, logprobs, receipt) as the last line")
    p.add_argument("--receipt", metavar="FILE", help="write the run's receipt JSON to FILE")
    p.add_argument("--plan", action="store_true", help="print the memory ledger and slot plan, then exit")
    add_engine_arguments(p)
    return p


def prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        try:
            ids = [int(x) for x in args.prompt_ids.replace(" ", "").split(",") if x != ""]
        except ValueError:
            raise MoestreamError(f"--prompt-ids must be comma-separated integers, got {args.prompt_ids!r}") from None
        if not ids:
            raise MoestreamError("--prompt-ids is empty")
        return ids
    if args.chat_prompt is not None:
        return tokenizer.chat_ids([{"role": "user", "content": args.chat_prompt}])
    return tokenizer.encode(args.prompt if args.prompt is not None else "def fibonacci(n):")


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refusals that need more than one flag's value, before any model is opened (exit 2)."""
    if not args.repetition_penalty > 0 or args.repetition_penalty == float("inf"):
        parser.error(f"argument --repetition-penalty: must be a positive finite number, not {args.repetition_penalty}")
    check_output_paths(parser, args, {"receipt": "--receipt", "trace_routing": "--trace-routing"})


def stats_line(receipt: dict) -> str:
    def rate(v):
        return f"{v:.1f}" if v is not None else "-"
    mb = (receipt["bytes_read_disk"] + receipt["bytes_read_host"]) / 1e6
    return (f"[moestream] prompt {receipt['prompt_tokens']} tok, generated {receipt['generated_tokens']} tok | "
            f"prefill {rate(receipt['prefill_tok_s'])} tok/s, decode {rate(receipt['decode_tok_s'])} tok/s | "
            f"expert hit rate {receipt['hit_rate']:.3f}, misses {receipt['misses']}, read {mb:.1f} MB "
            f"(disk {receipt['bytes_read_disk'] / 1e6:.1f} MB), read wait {receipt['read_wait_s']:.3f} s | "
            f"threads {receipt['threads']}, verify {'on' if receipt['verify'] else 'off'}")


def run(args) -> int:
    from moestream.engine.plan import load_engine

    options = EngineOptions.from_args(args)
    if args.plan:
        from moestream.engine.engine import DEMO_CACHE_SIZE, DEMO_MODEL
        from moestream.engine.plan import plan_run
        from moestream.format.reader import PackedModel

        packed = PackedModel(args.model or DEMO_MODEL)
        plan = plan_run(packed, options, default_cache_size=DEMO_CACHE_SIZE if not args.model else "auto")
        print(f"{packed.directory} ({packed.family})\n{plan.describe()}")
        return 0
    engine = load_engine(args.model, options)
    try:
        return generate(args, engine)
    finally:
        engine.close()


def generate(args, engine) -> int:
    """Generated text (or the JSON object) on stdout, the stats line on stderr. The prompt is echoed
    only once the prefill has succeeded, so a run that fails there prints nothing on stdout."""
    from moestream.engine.tokenizer import NoTokenizer

    ids = prompt_ids(args, engine.tokenizer)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    gen = engine.generate(ids, max_new_tokens=args.max_new, sampling=sampling, logprobs=args.logprobs)
    as_ids = isinstance(engine.tokenizer, NoTokenizer)  # no text to show: the generated ids, comma-separated
    decoder = IncrementalDecoder(engine.tokenizer.decode)
    echo = "" if args.prompt_ids is not None or args.chat_prompt is not None else engine.tokenizer.decode(ids)
    logprobs, first = [], True
    for event in gen:
        if args.logprobs:
            logprobs.append([[t, lp] for t, lp in event.top_logprobs])
        text = f"{'' if first else ','}{event.token_id}" if as_ids else decoder.push(event.token_id)
        if first and not args.json:
            text = echo + text
        first = False
        if text and not args.json:
            sys.stdout.write(text)
            sys.stdout.flush()
    result = gen.result
    tail = "" if as_ids else decoder.flush()
    if not args.json:
        sys.stdout.write((echo if first else "") + tail + "\n")
    receipt = dict(result.receipt)
    if args.receipt:
        with open(args.receipt, "w") as fh:
            json.dump(receipt, fh, indent=1)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": engine.tokenizer.decode(result.token_ids),
                          "logprobs": logprobs, "finish_reason": result.finish_reason, "receipt": receipt}))
    print(stats_line(receipt), file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    try:
        return run(args)
    except MoestreamError as exc:
        print(f"moestream generate: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
