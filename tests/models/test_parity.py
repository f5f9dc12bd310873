"""Every family against transformers (eager attention and experts) on tiny random checkpoints."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from moestream.cpu_share import kernels as native
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.convert.export_hf import export_hf

FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "glm4_moe", "deepseek_v3", "glm4_moe_lite", "gemma4_text", "gpt_oss", "minimax_m2",
            "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"]
STEPS = 24
# measured 0.002-0.02 on most of these tiny random models, 0.07-0.09 on qwen3_5_moe and deepseek_v3,
# 0.19 on gemma4_text (its near-flat distributions move most); the float rows are 1e-6 away
INT8_TOTAL_VARIATION = 0.25


def load_reference(folder):
    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                                                dtype=torch.float32).eval()


def reference_greedy(ref, prompt, steps, eos):
    """Greedy tokens and the log-probability of each, recomputing the whole sequence each step."""
    seq, tokens, logprobs = list(prompt), [], []
    with torch.no_grad():
        for _ in range(steps):
            lp = ref(torch.tensor([seq])).logits[0, -1].log_softmax(-1)
            t = int(lp.argmax())
            if t in eos:
                break
            tokens.append(t)
            logprobs.append(float(lp[t]))
            seq.append(t)
    return tokens, logprobs


def prompt_for(engine):
    return engine.tokenizer.encode("def fibonacci(n):\n    return")


def check_against(engine, ref):
    prompt = prompt_for(engine)
    logits, _ = engine.prefill(prompt, all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].log_softmax(-1)
    assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-4
    gen = engine.generate(prompt, max_new_tokens=STEPS, logprobs=1)
    events = list(gen)
    ref_tokens, ref_lp = reference_greedy(ref, prompt, STEPS, engine.tokenizer.eos_token_ids)
    assert [e.token_id for e in events] == ref_tokens
    assert max(abs(e.logprob - r) for e, r in zip(events, ref_lp)) < 1e-4
    assert len(ref_tokens) > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_matches_transformers(family, tiny_checkpoint, tiny_packed_model):
    engine = Engine.load(tiny_packed_model(family, "none"), options=EngineOptions(device="cpu"))
    check_against(engine, load_reference(tiny_checkpoint(family)))


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_matches_transformers_on_dequantized_weights(family, tiny_packed_model, tmp_path, float_activations):
    packed = tiny_packed_model(family, "q4")
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    check_against(engine, load_reference(export_hf(packed, tmp_path / "hf")))


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_on_int8_activations_stays_near_transformers(family, tiny_packed_model, tmp_path):
    """Where the CPU has VNNI every packed product rounds its inputs to int8 per 32 (about 0.5 % of
    a product; the kernels' exactness against that rounding: tests/unit/test_packed_matrix.py): each
    prompt position's next-token distribution stays within INT8_TOTAL_VARIATION of transformers' on
    the dequantized weights; without VNNI (the float rows), 1e-4."""
    packed = tiny_packed_model(family, "q4")
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    ref = load_reference(export_hf(packed, tmp_path / "hf"))
    prompt = prompt_for(engine)
    logits, _ = engine.prefill(prompt, all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt])).logits[0].softmax(-1)
    error = (logits.softmax(-1) - expected).abs().sum(-1).max().item() / 2  # total variation, worst row
    assert error < (INT8_TOTAL_VARIATION if native.vnni() else 1e-4), error


def test_chunked_prefill_and_prefix_reuse_give_the_same_tokens(tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "none")
    whole = Engine.load(packed, options=EngineOptions(device="cpu", prefill_chunk_tokens=4096))
    chunked = Engine.load(packed, options=EngineOptions(device="cpu", prefill_chunk_tokens=3))
    prompt = prompt_for(whole)
    a = list(whole.generate(prompt, max_new_tokens=12, logprobs=1))
    b = list(chunked.generate(prompt, max_new_tokens=12, logprobs=1))
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-5
    # the second request shares the prompt: only the new tokens are prefilled
    longer = prompt + [e.token_id for e in a[:3]]
    gen = chunked.generate(longer, max_new_tokens=9, logprobs=1)
    c = list(gen)
    assert gen.result.receipt["reused_tokens"] == len(longer) - 1
    assert gen.result.receipt["prefill_tokens"] == 1
    assert [e.token_id for e in c] == [e.token_id for e in a[3:]]
