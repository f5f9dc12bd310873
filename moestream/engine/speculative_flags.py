"""The speculative-decoding flags that `generate`, `serve` and `bench` share, and the
SpeculativeOptions they make."""
from __future__ import annotations

import argparse

from moestream.cli_args import at_least
from moestream.engine.options import EngineOptions
from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError


def speculative_value(text: str) -> tuple[str, str | None]:
    from moestream.engine.speculative import parse_speculative

    try:
        return parse_speculative(text)
    except MoestreamError as exc:
        raise argparse.ArgumentTypeError(f"must be off, ngram, mtp or draft:PATH, not {text!r}") from exc


def draft_tokens_value(text: str) -> int | None:
    """`auto` (None: the adaptive policy) or a whole number >= 0."""
    return None if text == "auto" else at_least(0)(text)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (the same tokens as without it)")
    g.add_argument("--speculative", type=speculative_value, default=("off", None), metavar="off|ngram|mtp|draft:PATH",
                   help="ngram: draft from earlier text of the context (prompt lookup); mtp: the model's own "
                        "multi-token-prediction layer; draft:PATH: a small packed model sharing the tokenizer; "
                        "off (default)")
    g.add_argument("--draft-tokens", type=draft_tokens_value, default=None, metavar="K|auto",
                   help="tokens drafted per verification: a number, or auto (default): chosen each step from "
                        "measured step times and acceptance")
    g.add_argument("--max-draft-tokens", type=at_least(1), default=8, help="most tokens auto drafts (default 8)")
    g.add_argument("--ngram", type=at_least(1), default=3, help="longest n-gram the ngram drafter matches (default 3)")
    g.add_argument("--hot-head", action="store_true",
                   help="greedy decoding through the hot-vocabulary head: its steps score only a list of common "
                        "tokens, and the full head checks them every few steps (exact)")


def speculating(args) -> bool:
    return bool(args.hot_head) or args.speculative[0] != "off"


def check_speculative_args(parser: argparse.ArgumentParser, args, *, sampling: SamplingParams | None) -> None:
    """Refusals between the speculative flags (exit 2). sampling: the run's sampling settings
    where they are known now (generate), so --hot-head can be refused for them."""
    if not args.hot_head:
        return
    if args.speculative[0] != "off":
        parser.error("argument --hot-head: not with --speculative (choose one)")
    if sampling is not None:
        from moestream.engine.hot_head import usable

        reason = usable(sampling)
        if reason is not None:
            parser.error(f"argument --hot-head: {reason}")


def speculative_options(args, engine):
    """SpeculativeOptions from the flags (None: plain decoding); may load a draft model."""
    from moestream.engine.speculative import SpeculativeOptions, make_options

    if args.hot_head:
        from moestream.engine.hot_head import HotHeadOptions

        return SpeculativeOptions(hot_head=HotHeadOptions())
    kind, path = args.speculative
    return make_options(kind, path, draft_tokens=args.draft_tokens, max_draft_tokens=args.max_draft_tokens,
                        max_ngram=args.ngram, main_engine=engine, engine_options=EngineOptions.from_args(args))
