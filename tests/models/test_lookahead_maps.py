"""Fitted lookahead maps on the demo model: `moestream fit-lookahead` writes them, the engine uses
them, its guesses (the receipt's `lookahead`) name more of the experts later layers choose, and the
tokens and their log-probabilities stay the same bits."""
import hashlib
import sysconfig
from pathlib import Path

import pytest

from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.commands.fit_lookahead import main as fit_main
from moestream.engine.options import EngineOptions
from moestream.errors import MoestreamError
from moestream.experts.guess_maps import FILE_NAME, GuessMaps

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not in the tree")
STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELD_OUT = STDLIB / "ast.py"  # a test-split file of the demo corpus (never trained on)


def corpus_test_files(count: int) -> list[str]:
    """Test-split files of the demo corpus (scripts/demo/corpus.py's rule), other than HELD_OUT."""
    out = []
    for f in sorted(STDLIB.rglob("*.py")):
        rel = f.relative_to(STDLIB).as_posix()
        if "site-packages" in f.parts or "encodings" in f.parts:
            continue
        if int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16) % 100 < 5 and f != HELD_OUT:
            out.append(str(f))
    return out[:count]


@pytest.fixture(scope="module")
def maps_file(tmp_path_factory):
    out = tmp_path_factory.mktemp("maps") / FILE_NAME
    files = corpus_test_files(12)
    assert len(files) >= 6
    assert fit_main([str(DEMO_MODEL), str(out), "--text", *files, "--tokens", "6144", "--file-tokens", "512"]) == 0
    return out


def run(maps: str, prompt_tokens: int = 192, new: int = 12):
    # the prompt fed a token a step: every prompt token is a guessed, scored step, as in decoding
    engine = Engine.load(options=EngineOptions(device="cpu", lookahead_maps=maps))
    prompt = engine.tokenizer.encode(HELD_OUT.read_text(), add_special_tokens=False)[:prompt_tokens]
    engine.prefill(prompt[:1])
    for token in prompt[1:-1]:
        engine.step([token])
    gen = engine.generate(prompt, max_new_tokens=new, logprobs=1, stop_at_eos=False)
    out = [(e.token_id, e.logprob) for e in gen]
    maps_used = engine.guess_maps is not None
    engine.close()
    return out, gen.result.receipt, maps_used


def test_fitted_maps_guess_better_and_change_no_bits(maps_file):
    maps = GuessMaps.load(maps_file)
    assert sorted(maps.maps) == sorted([(layer, 1) for layer in range(1, 8)] + [(layer, 2) for layer in range(2, 8)])
    check = maps.meta["check_accuracy"]
    assert check["depth1"]["fitted"] > check["depth1"]["router"]  # on the files the fit kept out
    plain, plain_receipt, used = run("none")
    assert not used
    fitted, fitted_receipt, used = run(str(maps_file))
    assert used
    assert fitted == plain  # tokens and log-probabilities: the same bits
    before, after = plain_receipt["lookahead"]["accuracy"]["depth1"], fitted_receipt["lookahead"]["accuracy"]["depth1"]
    assert after > before + 0.01, (before, after)
    assert fitted_receipt["experts"]["prefetch_issued"] > 0


def test_maps_next_to_the_model_are_found_and_foreign_maps_refused(maps_file, tmp_path):
    import shutil

    model = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL, model)
    shutil.copy(maps_file, model / FILE_NAME)
    engine = Engine.load(model, options=EngineOptions(device="cpu"))
    assert engine.guess_maps is not None  # auto: MODEL/lookahead.safetensors
    engine.close()
    maps = GuessMaps.load(maps_file)
    maps.meta["model_manifest_sha256"] = "0" * 64
    foreign = tmp_path / "foreign.safetensors"
    maps.save(foreign)
    with pytest.raises(MoestreamError, match="fitted for another model"):
        Engine.load(options=EngineOptions(device="cpu", lookahead_maps=str(foreign)))
