"""The speculative-decoding flags that `generate`, `serve` and `bench` share, and the
SpeculativeOptions they make.

`--draft` chooses the drafter: `auto` (default) is, where speculation can run, prompt lookup on
the CPU and on a GPU the draft model shipped with the model (its `draft/` folder) where there is
one, else plain decoding; `ngram`, a draft
model's folder, or `off`. `--speculative` is its older spelling (`draft:PATH` still reads as PATH)."""
from __future__ import annotations

import argparse
from pathlib import Path

from moestream.engine.types import SamplingParams
from moestream.errors import MoestreamError
from moestream.flag_values import at_least


def draft_value(text: str) -> tuple[str, str | None]:
    from moestream.engine.draft_choice import parse_draft

    try:
        kind, path = parse_draft(text)
    except MoestreamError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if kind == "draft" and not (Path(path) / "moestream.json").is_file():
        raise argparse.ArgumentTypeError(f"{path} is not a packed model (no moestream.json); give off, auto, ngram, "
                                         f"mtp or a draft model's folder")
    return kind, path


def draft_tokens_value(text: str) -> int | None:
    """`auto` (None: the adaptive policy) or a whole number >= 0."""
    return None if text == "auto" else at_least(0)(text)


def add_speculative_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("speculative decoding (the same tokens as without it)")
    g.add_argument("--draft", "--speculative", dest="draft", type=draft_value, default=("auto", None),
                   metavar="auto|ngram|mtp|DIR|off",
                   help="which drafter (default auto: ngram on the CPU, a shipped draft model on a GPU)")
    g.add_argument("--draft-tokens", type=draft_tokens_value, default=None, metavar="K|auto",
                   help="tokens drafted per step, or auto (default: chosen from step times and acceptance)")
    g.add_argument("--draft-max", "--max-draft-tokens", dest="max_draft_tokens", type=at_least(1), default=8,
                   metavar="N", help="most tokens auto drafts (default 8)")
    g.add_argument("--ngram", type=at_least(1), default=3, metavar="N", help="longest n-gram the ngram drafter matches (default 3)")
    g.add_argument("--hot-head", action="store_true",
                   help="greedy decoding through the hot-vocabulary head (exact)")


def speculating(args) -> bool:
    """After check_speculative_args: whether this run decodes speculatively."""
    return bool(args.hot_head) or args.draft[0] != "off"


def check_speculative_args(parser: argparse.ArgumentParser, args, *, sampling: SamplingParams | None,
                           model_dir: str | Path | None, not_here: str | None = None, batched: bool = False) -> None:
    """Refusals between the speculative flags (exit 2), and `--draft auto` resolved to what runs.
    sampling: the run's sampling settings where they are known now (generate), so --hot-head can be
    refused for them; model_dir: the model (None: the demo), whose draft/ auto takes; not_here: why
    this run cannot speculate at all (auto then decodes plainly, an explicit choice is refused);
    batched: several sequences decode together (serve --parallel above 1): only ngram drafts there."""
    kind = args.draft[0]
    if not_here and (args.hot_head or kind not in ("off", "auto")):
        parser.error(f"argument --draft/--hot-head: {not_here}")
    if batched and (args.hot_head or kind not in ("off", "auto", "ngram")):
        parser.error("argument --draft/--hot-head: with --parallel above 1 only ngram drafts (a draft model, MTP "
                     "and the hot head follow one sequence)")
    if kind == "auto":
        args.draft = ("off", None) if args.hot_head or not_here or batched else \
            auto_draft(model_dir, on_cpu=runs_on_cpu(getattr(args, "device", "auto")))
    elif kind == "draft":
        from moestream.engine.engine import DEMO_MODEL
        from moestream.engine.draft_choice import tokenizer_mismatch

        main = model_dir or DEMO_MODEL
        reason = tokenizer_mismatch(main, args.draft[1]) if (Path(main) / "moestream.json").is_file() else None
        if reason:
            parser.error(f"argument --draft/--speculative: {reason}")
    if not args.hot_head:
        return
    if kind not in ("off", "auto"):
        parser.error("argument --hot-head: not with --draft (choose one)")
    if sampling is not None:
        from moestream.engine.hot_head import usable

        reason = usable(sampling)
        if reason is not None:
            parser.error(f"argument --hot-head: {reason}")


def runs_on_cpu(device: str | None) -> bool:
    """Whether a run with this --device computes on the CPU (auto: where CUDA is not available)."""
    if device in (None, "auto"):
        import torch

        return not torch.cuda.is_available()
    return str(device).startswith("cpu")


def auto_draft(model_dir: str | Path | None, *, on_cpu: bool = False) -> tuple[str, str | None]:
    """The best drafter measured for where the run computes: on the CPU prompt lookup (ngram), since
    there each drafted token makes a verification step dearer and a draft model's own steps cost
    more than they save (docs/PERFORMANCE.md: the demo's draft model 0.95-1.00x, ngram 1.42-1.73x); on a
    GPU the model's shipped draft model (its draft/ folder) where there is one, else off."""
    from moestream.engine.engine import DEMO_MODEL
    from moestream.engine.draft_choice import shipped_draft

    if on_cpu:
        return "ngram", None
    found = shipped_draft(model_dir or DEMO_MODEL)
    return ("draft", str(found)) if found is not None else ("off", None)


def speculative_options(args, engine):
    """SpeculativeOptions from the flags (None: plain decoding); may load a draft model."""
    from moestream.commands.engine_args import options_from_args
    from moestream.engine.draft_choice import make_options
    from moestream.engine.speculative import SpeculativeOptions

    if args.hot_head:
        from moestream.engine.hot_head import DRAFT_TOKENS, HotHeadDrafter

        return SpeculativeOptions(drafter=HotHeadDrafter(engine), draft_tokens=DRAFT_TOKENS)
    kind, path = args.draft
    return make_options(kind, path, draft_tokens=args.draft_tokens, max_draft_tokens=args.max_draft_tokens,
                        max_ngram=args.ngram, main_engine=engine, engine_options=options_from_args(args))
