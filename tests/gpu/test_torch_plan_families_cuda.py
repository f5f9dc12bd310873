"""Families whose experts take the torch plan on CUDA (the Triton expert kernels compute SwiGLU
only: Gemma 4's GELU-tanh, gpt-oss's clamped SwiGLU with biases) and whose attention takes the
masked torch step (windows, sinks, scales), through the generic decoder: the greedy tokens equal the
CPU reference's, the bits are the same for every cache size and with graphs on or off, and
step(T tokens) = T one-token steps bit for bit."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu
FAMILIES = ["gemma4_text", "gpt_oss"]
PROMPT = "def fibonacci(n):\n    if n < 2:"
STEPS = 32


def load(packed, **opts):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "max_context": 256, **opts}))


def greedy(engine, prompt):
    events = list(engine.generate(prompt, max_new_tokens=STEPS, logprobs=1, stop_at_eos=False))
    return [e.token_id for e in events], [e.logprob for e in events]


@pytest.mark.parametrize("family", FAMILIES)
def test_decodes_like_the_cpu_reference_on_the_torch_expert_plan(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    cpu = Engine.load(packed, options=EngineOptions(device="cpu", threads=1))
    prompt = cpu.tokenizer.encode(PROMPT)
    ref_tokens, ref_lp = greedy(cpu, prompt)
    cpu.close()
    engine = load(packed, dtype="float32", cache_size="all")
    assert not any(engine.experts.uses_triton(i, engine.dtype) for i in engine.args.moe_layers())
    tokens, lp = greedy(engine, prompt)
    engine.close()
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_for_every_cache_size_and_graphs_on_or_off(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    runs = {}
    for size, graphs in (("min", True), ("50%", True), ("all", True), ("all", False)):
        engine = load(packed, dtype="bfloat16", cache_size=size, cuda_graphs=graphs)
        runs[(size, graphs)] = greedy(engine, engine.tokenizer.encode(PROMPT))
        engine.close()
    first = next(iter(runs.values()))
    assert all(value == first for value in runs.values()), runs.keys()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["all", "min"])
def test_step_of_t_tokens_equals_t_single_steps_on_cuda(family, size, tiny_packed_model):
    engine = load(tiny_packed_model(family, "q4", dtype="bfloat16"), dtype="bfloat16", cache_size=size)
    prompt = engine.tokenizer.encode(PROMPT)
    draft = [5, 17, 300, 42, 9, 250, 77, 3]
    engine.prefill(prompt)
    for T in (len(draft), 3, 1):
        engine.rollback(len(prompt))
        together = engine.step(draft[:T])
        engine.rollback(len(prompt))
        assert torch.equal(together, torch.cat([engine.step([t]) for t in draft[:T]])), T
    engine.close()
