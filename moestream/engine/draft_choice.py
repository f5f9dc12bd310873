"""Which drafter a run speculates with: the `--draft` values, the draft model a model ships (its
`draft/` folder), the check that a draft model speaks the model's tokens, and the
SpeculativeOptions of a resolved choice (loading a draft model as its own Engine)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from moestream.engine.engine import Engine
from moestream.engine.mtp_drafter import MTPDrafter
from moestream.engine.options import EngineOptions
from moestream.engine.speculative import DraftModelDrafter, Drafter, NGramDrafter, SpeculativeOptions
from moestream.engine.tokenizer import load_tokenizer
from moestream.errors import MoestreamError
from moestream.format.reader import PackedModel

DRAFT_FOLDER = "draft"  # a model's own draft model: MODEL/draft/, a packed model sharing its tokenizer


def parse_draft(value: str) -> tuple[str, str | None]:
    """`off`, `ngram`, `mtp`, `auto`, or a packed draft model's folder (also spelled `draft:PATH`) -> (kind, path)."""
    if value in ("off", "ngram", "mtp", "auto"):
        return value, None
    path = value[len("draft:"):] if value.startswith("draft:") else value
    if not path:
        raise MoestreamError(f"the draft must be off, auto, ngram, mtp or a draft model's folder, not {value!r}")
    return "draft", path


def shipped_draft(model_dir: str | Path) -> Path | None:
    """The draft model shipped with a model (its `draft/` folder holding a packed model), if any."""
    folder = Path(model_dir) / DRAFT_FOLDER
    return folder if (folder / "moestream.json").is_file() else None


def tokenizer_mismatch(model_dir: str | Path, draft_dir: str | Path) -> str | None:
    """Why the draft at draft_dir cannot draft for the model at model_dir (None: it can): a draft
    must speak the model's tokens, the same vocabulary id for id. Reads manifests and tokenizers only."""
    main, draft = PackedModel(model_dir), PackedModel(draft_dir)
    a, b = main.config.get("vocab_size"), draft.config.get("vocab_size")
    if a != b:
        return f"{draft_dir} does not share the model's tokenizer (a vocabulary of {b} tokens, the model's has {a})"
    vocab = [getattr(load_tokenizer(m.directory, m.config), "backend", None) for m in (main, draft)]
    if None not in vocab and vocab[0].get_vocab() != vocab[1].get_vocab():  # (token ids alone: sizes only)
        return f"{draft_dir} does not share the model's tokenizer (as many tokens, other ones)"
    return None


def draft_engine_options(engine_options):
    """The draft engine beside the model: its experts resident where they fit, one sequence, nothing
    recorded, no CPU share or lookahead (the model verifies whatever it drafts)."""
    return replace(engine_options or EngineOptions(), trace_routing=None, cache_size="auto", host_cache_size="0",
                   memory_budget=None, max_sequences=1, cpu_experts="off", lookahead_maps="none",
                   expert_parallel=None, expert_placement=None)


def make_options(kind: str, path: str | None, *, draft_tokens: int | None, max_draft_tokens: int = 8,
                 max_ngram: int = 3, main_engine=None, engine_options=None) -> SpeculativeOptions | None:
    """SpeculativeOptions for a resolved draft choice (None for off); loads a draft model's Engine."""
    if kind == "off":
        return None
    if kind == "ngram":
        drafter: Drafter = NGramDrafter(max_ngram=max_ngram)
    elif kind == "mtp":  # the model's own multi-token-prediction layer
        drafter = MTPDrafter(main_engine)
    elif kind == "draft":
        if not (Path(path) / "moestream.json").is_file():
            raise MoestreamError(f"the draft model {path} is not a packed model (no moestream.json)")
        draft_engine = Engine.load(path, options=draft_engine_options(engine_options), prefetch=False,
                                   digest_dir=getattr(main_engine, "digest_dir", None))
        try:
            if main_engine is not None and draft_engine.args.vocab_size != main_engine.args.vocab_size:
                raise MoestreamError(f"the draft model {path} does not share the model's tokenizer (a vocabulary "
                                     f"of {draft_engine.args.vocab_size} tokens, the model's has "
                                     f"{main_engine.args.vocab_size})")
            drafter = DraftModelDrafter(draft_engine)
        except BaseException:
            draft_engine.close()
            raise
    else:
        raise MoestreamError(f"unresolved draft choice {kind!r}")
    return SpeculativeOptions(drafter=drafter, draft_tokens=draft_tokens, max_draft_tokens=max_draft_tokens)
