"""The real Gemma 4 26B-A4B shape (its first two layers: a sliding and a full one) on CUDA: 2816-wide
GELU-tanh experts of 704 through the Triton kernels, 512-wide heads on the full layer, the full
262144-token vocabulary tied to the embedding; the logits finite and soft-capped."""
import pytest
import torch

from moestream.bench.synth import synth
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu
PROMPT = [5, 17, 42, 99, 300]


def test_gemma4_26b_a4b_shape_decodes_on_cuda(tmp_path):
    out = synth("gemma-4-26b-a4b", tmp_path / "m", layers=2)
    engine = Engine.load(out, options=EngineOptions(device="cuda", max_context=256))
    try:
        assert [(s.heads, s.k_dim) for s in engine.args.kv_layout()] == [(8, 256), (2, 512)]
        logits, _ = engine.prefill(PROMPT)
        assert logits.shape[-1] == 262144 and torch.isfinite(logits).all() and logits.abs().max() <= 30.0
        engine.reset()
        tokens = [e.token_id for e in engine.generate(PROMPT, max_new_tokens=4, stop_at_eos=False)]
        assert len(tokens) == 4 and all(0 <= t < 262144 for t in tokens)
    finally:
        engine.close()
