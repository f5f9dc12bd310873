"""The demo model's shipped draft model (moestream/demo/model/draft): used by default, and its
speculative decoding gives plain decoding's tokens over long runs, greedy and seeded sampling, with
all experts resident and with a quarter of them (CPU)."""
import argparse
import json

import pytest

from moestream.commands.generate import build_parser as generate_parser, main as generate_main
from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.engine.options import EngineOptions
from moestream.engine.draft_choice import make_options, shipped_draft
from moestream.engine.speculative import DraftModelDrafter
from moestream.commands.speculative_flags import check_speculative_args
from moestream.engine.types import SamplingParams
from moestream.commands.serve import build_parser as serve_parser

DRAFT = DEMO_MODEL / "draft"
pytestmark = pytest.mark.skipif(not (DRAFT / "moestream.json").is_file(), reason="the demo's draft is not in this checkout")
PROMPT = 'def read_config(path):\n    """Read a configuration file and return a dict."""\n'
TOKENS = 220


def run(engine, prompt, sampling, speculative=None):
    engine.reset()
    gen = engine.generate(prompt, max_new_tokens=TOKENS, sampling=sampling, stop_at_eos=False, speculative=speculative)
    return [e.token_id for e in gen], gen.result.receipt


@pytest.mark.parametrize("cache_size", ["all", "25%"])
def test_shipped_draft_equals_plain(cache_size):
    engine = Engine.load(options=EngineOptions(device="cpu", threads=1, cache_size=cache_size))
    prompt = engine.tokenizer.encode(PROMPT)
    spec = make_options("draft", str(DRAFT), draft_tokens=3, main_engine=engine,
                        engine_options=EngineOptions(device="cpu", threads=1, cache_size=cache_size))
    try:
        assert isinstance(spec.drafter, DraftModelDrafter)
        assert spec.drafter.engine.plan.slots == spec.drafter.engine.plan.total_experts  # the draft never streams
        for sampling in (SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=7)):
            plain, _ = run(engine, prompt, sampling)
            assert len(plain) == TOKENS
            out, receipt = run(engine, prompt, sampling, spec)  # a fixed length: every step verifies 3 drafts
            assert out == plain, (cache_size, sampling)
            r = receipt["speculative"]
            assert r["drafter"] == "draft" and r["drafted"] >= 3 * (TOKENS // 4) and r["accepted"] > 0
    finally:
        spec.drafter.close()
        engine.close()


def resolved(parser, argv, **kwargs):
    args = parser.parse_args(argv)
    check_speculative_args(parser, args, sampling=None, model_dir=args.model, **kwargs)
    return args.draft


def test_the_default_is_the_shipped_draft(tmp_path):
    assert shipped_draft(DEMO_MODEL) == DRAFT
    p = generate_parser()
    assert resolved(p, ["--device", "cuda"]) == ("draft", str(DRAFT))  # on a GPU: the shipped draft
    assert resolved(p, ["--draft", "auto", "--device", "cuda:0"]) == ("draft", str(DRAFT))
    assert resolved(p, ["--device", "cpu"]) == ("ngram", None)  # on the CPU: what measured best there
    assert resolved(p, ["--draft", "off"]) == ("off", None)
    assert resolved(p, ["--speculative", "ngram"]) == ("ngram", None)  # the older spelling
    assert resolved(p, ["--draft", f"draft:{DRAFT}"]) == ("draft", str(DRAFT))
    assert resolved(p, ["--hot-head"]) == ("off", None)  # the hot head instead of the default draft
    assert resolved(p, ["--model", str(DRAFT), "--device", "cuda"]) == ("off", None)  # a model without a draft/ folder
    assert resolved(p, [], not_here="why") == ("off", None)  # auto never refuses: it decodes plainly
    assert p.parse_args(["--draft-max", "5"]).max_draft_tokens == 5
    s = serve_parser()
    assert resolved(s, ["--device", "cuda"]) == ("draft", str(DRAFT))
    args = s.parse_args(["--parallel", "2"])
    check_speculative_args(s, args, sampling=None, model_dir=None, not_here="batched")
    assert args.draft == ("off", None)


@pytest.mark.parametrize("flags,drafter", [([], "ngram"), (["--draft", "off"], None), (["--speculative", "off"], None),
                                           (["--draft", str(DRAFT)], "draft")])
def test_generate_uses_the_draft_unless_told(flags, drafter, tmp_path, capsys):
    receipt = tmp_path / "r.json"
    rc = generate_main(["--prompt", PROMPT, "--max-new", "24", "--device", "cpu", "--threads", "1",
                        "--receipt", str(receipt), *flags])
    assert rc == 0
    spec = json.loads(receipt.read_text()).get("speculative")
    assert (spec or {}).get("drafter") == drafter


def test_draft_flag_is_one_argument():
    """--draft and --speculative, --draft-max and --max-draft-tokens: one flag each, two spellings."""
    p = generate_parser()
    actions = {a.dest: a for a in p._actions if isinstance(a, argparse.Action)}
    assert {"--draft", "--speculative"} <= set(actions["draft"].option_strings)
    assert {"--draft-max", "--max-draft-tokens"} <= set(actions["max_draft_tokens"].option_strings)
