"""`moestream generate`: run a packed model on a prompt, streaming text, then a stats line."""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from moestream.commands.args import Parser, check_output_paths, fail
from moestream.commands.engine_args import add_engine_arguments, check_engine_args, digest_dir, options_from_args
from moestream.commands.launch import add_parallel_arguments, init_group, leave_group, spawn_ranks, torchrun_rank
from moestream.commands.speculative_flags import add_speculative_arguments, check_speculative_args, speculative_options
from moestream.engine.detok import IncrementalDecoder
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError
from moestream.flag_values import at_least, non_negative_float, probability_mass, unit_interval


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="moestream generate", description="Generate text with a packed MoE model.")
    p.add_argument("--model", metavar="DIR", help="packed model directory (default: the demo model)")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", metavar="TEXT", help="raw prompt text")
    src.add_argument("--chat-prompt", metavar="TEXT", help="a user message, wrapped in the model's chat template")
    src.add_argument("--prompt-ids", type=id_list, metavar="IDS", help="comma-separated token ids, e.g. 1,2,3")
    p.add_argument("--max-new", type=at_least(1), default=128, metavar="N", help="most tokens to generate (default 128)")
    p.add_argument("--temperature", type=non_negative_float, default=0.0, metavar="T", help="0 is greedy (default 0)")
    p.add_argument("--top-k", type=at_least(0), default=0, metavar="K", help="sample among the k most likely (0: off)")
    p.add_argument("--top-p", type=probability_mass, default=1.0, metavar="P", help="nucleus sampling mass (1: off)")
    p.add_argument("--min-p", type=unit_interval, default=0.0, metavar="P",
                   help="drop tokens below P x the top probability (0: off)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="X", help="transformers-style repetition penalty (1: off)")
    p.add_argument("--seed", type=at_least(0), default=0, metavar="N", help="sampling seed: the same seed, the same text")
    p.add_argument("--logprobs", type=at_least(0), default=0, metavar="N", help="report the top N logprobs of every generated token")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object (ids, text, receipt)")
    p.add_argument("--receipt", metavar="FILE", help="write the run's receipt JSON to FILE")
    p.add_argument("--timeline", metavar="FILE.json", help="write a Chrome/Perfetto trace of the run")
    p.add_argument("--plan", action="store_true", help="print the memory ledger and slot plan, then exit")
    add_speculative_arguments(p)
    add_engine_arguments(p)
    add_parallel_arguments(p)
    return p


def id_list(text: str) -> list[int]:
    """--prompt-ids: comma-separated token ids."""
    try:
        ids = [int(x) for x in text.replace(" ", "").split(",") if x != ""]
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be comma-separated whole numbers, not {text!r}") from None
    if not ids:
        raise argparse.ArgumentTypeError("gives no token ids")
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"token ids are at least 0, not {min(ids)}")
    return ids


def prompt_ids(args, tokenizer) -> list[int]:
    if args.prompt_ids is not None:
        return args.prompt_ids
    if args.chat_prompt is not None:
        return tokenizer.chat_ids([{"role": "user", "content": args.chat_prompt}])
    return tokenizer.encode(args.prompt if args.prompt is not None else "def fibonacci(n):")


def check_args(parser: argparse.ArgumentParser, args) -> None:
    """Refusals that need more than one flag's value, before any model is opened (exit 2)."""
    if not args.repetition_penalty > 0 or args.repetition_penalty == float("inf"):
        parser.error(f"argument --repetition-penalty: must be a positive finite number, not {args.repetition_penalty}")
    check_output_paths(parser, args, {"receipt": "--receipt", "trace_routing": "--trace-routing",
                                      "timeline": "--timeline"})
    check_engine_args(parser, args)
    if args.devices is not None and args.device != "auto":
        parser.error("argument --devices: not with --device (--devices lists every rank's device)")
    try:
        ranked = torchrun_rank()
    except MoestreamError as exc:
        parser.error(str(exc))
    parallel = (args.devices is not None and len(args.devices) > 1) or ranked is not None
    if parallel and args.cpu_experts not in ("off", "auto"):
        parser.error("argument --cpu-experts: not with expert parallelism (--devices, torchrun)")
    if args.expert_placement is not None and not parallel:
        parser.error("argument --expert-placement: only with expert parallelism (--devices with 2 or more, torchrun)")
    if args.expert_placement is not None and not os.path.isfile(args.expert_placement):
        parser.error(f"argument --expert-placement: no routing trace at {args.expert_placement}")
    # every rank must run the same steps; the adaptive drafter times steps, so ranks could differ
    check_speculative_args(parser, args, sampling=SamplingParams(
        temperature=args.temperature, repetition_penalty=args.repetition_penalty), model_dir=args.model,
        not_here="not with expert parallelism (--devices, torchrun)" if parallel else None)


def stats_line(receipt: dict) -> str:
    def rate(v):
        return f"{v:.1f}" if v is not None else "-"
    mb = (receipt["bytes_read_disk"] + receipt["bytes_read_host"]) / 1e6
    return (f"[moestream] prompt {receipt['prompt_tokens']} tok, generated {receipt['generated_tokens']} tok | "
            f"prefill {rate(receipt['prefill_tok_s'])} tok/s, decode {rate(receipt['decode_tok_s'])} tok/s | "
            f"expert hit rate {receipt['hit_rate']:.3f}, misses {receipt['misses']}, read {mb:.1f} MB "
            f"(disk {receipt['bytes_read_disk'] / 1e6:.1f} MB), read wait {receipt['read_wait_s']:.3f} s | "
            f"threads {receipt['threads']}, verify {'on' if receipt['verify'] else 'off'}" + speculative_stats(receipt)
            + cpu_share_stats(receipt))


def cpu_share_stats(receipt: dict) -> str:
    experts = receipt.get("experts") or {}
    if "cpu_share" not in experts:
        return ""
    rate = experts.get("cpu_gb_s")
    return (f" | cpu experts {experts['cpu_experts']} ({experts['cpu_share']}), "
            f"fallbacks {experts['cpu_fallbacks']}, {rate if rate is not None else '-'} GB/s")


def speculative_stats(receipt: dict) -> str:
    spec = receipt.get("speculative")
    if not spec:
        return ""
    rate = "-" if spec["accept_rate"] is None else f"{spec['accept_rate']:.3f}"
    per = "-" if spec["tokens_per_step"] is None else f"{spec['tokens_per_step']:.2f}"
    return (f" | speculative {spec['drafter']} ({spec['draft_tokens']}): drafted {spec['drafted']}, "
            f"accepted {spec['accepted']} ({rate}), {per} tok/step")


def run(args, group=None) -> int:
    """One process's run; `group`: this rank's ExpertGroup under expert parallelism (only rank 0 prints)."""
    from dataclasses import replace

    from moestream.engine.engine import load_engine

    options = replace(options_from_args(args), expert_parallel=group)
    if args.plan:
        from moestream.engine.engine import DEMO_CACHE_SIZE, DEMO_MODEL
        from moestream.engine.plan import plan_run
        from moestream.format.reader import PackedModel

        packed = PackedModel(args.model or DEMO_MODEL)
        plan = plan_run(packed, options, default_cache_size=DEMO_CACHE_SIZE if not args.model else "auto",
                        digest_dir=digest_dir())
        print(f"{packed.directory} ({packed.family})\n{plan.describe()}")
        return 0
    engine = load_engine(args.model, options, digest_dir=digest_dir())
    speculative = None
    try:
        speculative = speculative_options(args, engine)
        from moestream.engine import timeline

        with timeline.recording(args.timeline, device=engine.device):
            return generate(args, engine, speculative, quiet=group is not None and group.rank != 0)
    finally:
        if speculative is not None and speculative.drafter is not None:
            speculative.drafter.close()
        engine.close()


def generate(args, engine, speculative=None, *, quiet: bool = False) -> int:
    """Generated text (or the JSON object) on stdout, the stats line on stderr. The prompt is echoed
    only once the prefill has succeeded, so a run that fails there prints nothing on stdout.
    quiet: run without printing or writing anything (expert-parallel ranks other than 0)."""
    from moestream.engine.tokenizer import NoTokenizer

    ids = prompt_ids(args, engine.tokenizer)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                              repetition_penalty=args.repetition_penalty, seed=args.seed)
    gen = engine.generate(ids, max_new_tokens=args.max_new, sampling=sampling, logprobs=args.logprobs,
                          speculative=speculative)
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
        if text and not args.json and not quiet:
            sys.stdout.write(text)
            sys.stdout.flush()
    result = gen.result
    if quiet:
        return 0
    tail = "" if as_ids else decoder.flush()
    if not args.json:  # the text ends its line before the stats line comes on stderr
        sys.stdout.write((echo if first else "") + tail + "\n")
        sys.stdout.flush()
    receipt = dict(result.receipt)
    if args.receipt:
        with open(args.receipt, "w") as fh:
            json.dump(receipt, fh, indent=1)
    if args.json:
        print(json.dumps({"token_ids": result.token_ids, "text": engine.tokenizer.decode(result.token_ids),
                          "logprobs": logprobs, "finish_reason": result.finish_reason, "receipt": receipt}), flush=True)
    print(stats_line(receipt), file=sys.stderr)
    if receipt.get("parallel"):
        print(parallel_line(receipt["parallel"]), file=sys.stderr)
    return 0


def parallel_line(parallel: dict) -> str:
    ranks = " | ".join(f"rank {r['rank']}: {r['experts_owned']} experts, hit rate {r['hit_rate']:.3f}, read "
                       f"{(r['bytes_read_disk'] + r['bytes_read_host']) / 1e6:.1f} MB, exchanges "
                       f"{r['collective_s']:.3f} s" for r in parallel["ranks"])
    return f"[moestream] expert parallel over {parallel['world_size']} ranks ({parallel['placement']}) | {ranks}"


def _rank_main(rank: int, devices: list[str], init_method: str, args) -> None:
    """One spawned rank of `--devices`: join the group, run, exit non-zero on failure."""
    code = _run_rank(args, rank=rank, world_size=len(devices), device=devices[rank], init_method=init_method)
    if code:
        sys.exit(code)


def _run_rank(args, *, rank: int, world_size: int, device: str, init_method: str) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args.device = device
    try:
        group = init_group(rank, world_size, device=device, init_method=init_method, timeout_s=args.dist_timeout)
        try:
            return run(args, group)
        finally:
            leave_group()
    except MoestreamError as exc:
        where = "" if str(exc).startswith(f"rank {rank}") else f"rank {rank}: "
        return fail("moestream generate", f"{where}{exc}")
    except KeyboardInterrupt:
        return 130


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    ranked = torchrun_rank()  # checked by check_args
    if ranked is not None and not args.plan:  # started by torchrun: one rank of its group
        rank, world, local = ranked
        device = args.devices[local] if args.devices else args.device
        if device in ("auto", "cuda"):
            import torch

            device = f"cuda:{local}" if torch.cuda.is_available() else "cpu"
        return _run_rank(args, rank=rank, world_size=world, device=device, init_method="env://")
    if args.devices is not None and len(args.devices) > 1 and not args.plan:
        return spawn_ranks(args.devices, _rank_main, args)
    if args.devices is not None:
        args.device = args.devices[0]
    try:
        return run(args)
    except MoestreamError as exc:
        return fail("moestream generate", str(exc))
    except KeyboardInterrupt:
        return 130
