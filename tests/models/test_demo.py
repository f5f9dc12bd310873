"""The built-in demo model: its greedy output is pinned, equals transformers' on the same dequantized
weights, and its default cache is small enough that the run streams experts from disk."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.engine.options import EngineOptions
from moestream.convert.export_hf import export_hf

PROMPT = "def fibonacci(n):"
PROMPT_IDS = [521, 862, 68, 273, 719, 627, 10, 80, 289]
STEPS = 24
# '\n    """Determine if the nearest to n.\n\n    This is a function that is called by the \''
GREEDY = [283, 421, 2429, 4478, 1109, 359, 340, 1071, 1297, 270, 409, 327, 16, 325, 1070, 369, 288, 1018, 600, 369,
          1534, 595, 340, 290]

pytestmark = pytest.mark.skipif(not (DEMO_MODEL / "moestream.json").is_file(), reason="the demo model is not in the tree")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """transformers' greedy tokens and their log-probabilities on the packed model's dequantized
    weights (float32, eager), recomputing the whole sequence at every step."""
    folder = export_hf(DEMO_MODEL, tmp_path_factory.mktemp("demo-hf"))
    model = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                                                 dtype=torch.float32).eval()
    seq, tokens, logprobs, prompt_logprobs = list(PROMPT_IDS), [], [], None
    with torch.no_grad():
        for _ in range(STEPS):
            lp = model(torch.tensor([seq])).logits[0].log_softmax(-1)
            if prompt_logprobs is None:
                prompt_logprobs = lp
            t = int(lp[-1].argmax())
            tokens.append(t)
            logprobs.append(float(lp[-1, t]))
            seq.append(t)
    return {"tokens": tokens, "logprobs": logprobs, "prompt_logprobs": prompt_logprobs}


def test_reference_greedy_is_the_pinned_output(reference):
    assert reference["tokens"] == GREEDY


@pytest.mark.parametrize("cache_size", ["auto", "min"])
def test_demo_greedy_is_pinned_and_equals_transformers(cache_size, reference, float_activations):
    engine = Engine.load(None, options=EngineOptions(device="cpu", cache_size=cache_size))
    try:
        prompt = engine.tokenizer.encode(PROMPT)
        assert prompt == PROMPT_IDS
        gen = engine.generate(prompt, max_new_tokens=STEPS, logprobs=1)
        events = list(gen)
        tokens = [e.token_id for e in events]
        assert tokens == GREEDY
        assert tokens == reference["tokens"]
        assert max(abs(e.logprob - r) for e, r in zip(events, reference["logprobs"])) < 1e-4
        # every prompt position, through the same cache
        logits, _ = engine.prefill(prompt, all_logits=True)
        assert (logits.log_softmax(-1) - reference["prompt_logprobs"]).abs().max().item() < 1e-4

        receipt, stats = gen.result.receipt, engine.expert_stats()
        assert receipt["generated_tokens"] == STEPS and receipt["finish_reason"] == "length"
        # the cache holds less than the model, so experts are read from disk while generating
        assert stats["slots"] < stats["total_experts"]
        assert receipt["hit_rate"] < 1 and receipt["misses"] > 0 and receipt["bytes_read_disk"] > 0
        if cache_size == "auto":
            assert stats["slots"] == round(0.30 * stats["total_experts"])  # the demo model's default: 30 %
            assert receipt["misses"] > stats["slots"]  # more misses than slots: evictions, not only a cold fill
    finally:
        engine.close()
