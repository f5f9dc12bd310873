"""Fitted lookahead maps in the CUDA decoder (inside its graphs): the same logits bits with and
without them, and better guesses one and two MoE layers ahead on the demo model's real routing."""
import hashlib
import sysconfig
from pathlib import Path

import pytest
import torch

from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.commands.fit_lookahead import main as fit_main
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu
STDLIB = Path(sysconfig.get_paths()["stdlib"])
HELD_OUT = STDLIB / "ast.py"


def corpus_test_files(count):
    out = []
    for f in sorted(STDLIB.rglob("*.py")):
        if "site-packages" in f.parts or "encodings" in f.parts or f == HELD_OUT:
            continue
        if int(hashlib.sha256(f.relative_to(STDLIB).as_posix().encode()).hexdigest()[:8], 16) % 100 < 5:
            out.append(str(f))
    return out[:count]


def teacher_forced(maps, tokens):
    """Logits of each step over `tokens` (one token per step after a short prefill) and the guess accuracy."""
    engine = Engine.load(options=EngineOptions(device="cuda", cache_size="30%", lookahead_maps=maps),
                         streaming="host")
    logits, _ = engine.prefill(tokens[:8])
    rows = [logits[-1].float().cpu()]
    for t in tokens[8:]:
        rows.append(engine.step([t])[-1].float().cpu())
    stats = engine.lookahead.stats()
    used = engine.guess_maps is not None
    engine.close()
    return torch.stack(rows), stats, used


def test_maps_change_no_bits_and_guess_better_on_cuda(tmp_path):
    out = tmp_path / "lookahead.safetensors"
    assert fit_main([str(DEMO_MODEL), str(out), "--text", *corpus_test_files(12), "--tokens", "6144",
                     "--file-tokens", "512"]) == 0
    engine = Engine.load(options=EngineOptions(device="cpu"))
    tokens = engine.tokenizer.encode(HELD_OUT.read_text(), add_special_tokens=False)[:200]
    engine.close()
    plain, plain_stats, used = teacher_forced("none", tokens)
    assert not used
    fitted, fitted_stats, used = teacher_forced(str(out), tokens)
    assert used
    assert torch.equal(plain, fitted)
    for depth in ("depth1",):
        before, after = plain_stats["accuracy"][depth], fitted_stats["accuracy"][depth]
        assert after > before + 0.01, (depth, before, after)
