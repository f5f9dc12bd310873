"""Gemma 4 (GELU-tanh experts) and gpt-oss (clamped SwiGLU experts with biases) on CUDA: their
experts take the Triton kernels, their attention the masked torch step
(windows, sinks, scales), through the generic decoder. The greedy tokens equal the CPU reference's
(the torch plan's), the bits are the same for every cache size, with graphs on or off and with
device-driven streaming, and step(T tokens) = T one-token steps bit for bit."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel

pytestmark = pytest.mark.gpu
FAMILIES = ["gemma4_text", "gpt_oss"]
PROMPT = "def fibonacci(n):\n    if n < 2:"
STEPS = 32


def load(packed, *, graphs=True, streaming="auto", **opts):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "max_context": 256, **opts}), graphs=graphs,
                       streaming=streaming)


def greedy(engine, prompt):
    events = list(engine.generate(prompt, max_new_tokens=STEPS, logprobs=1, stop_at_eos=False))
    return [e.token_id for e in events], [e.logprob for e in events]


def slots(packed, n: int) -> str:
    return str(n * max(e.record_size for e in PackedModel(packed).manifest.expert_layers))


def triton_layers(engine) -> list[bool]:
    return [engine.experts.uses_triton(i, engine.dtype) for i in engine.args.moe_layers()]


@pytest.mark.parametrize("family", FAMILIES)
def test_decodes_like_the_cpu_reference(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    cpu = Engine.load(packed, options=EngineOptions(device="cpu", threads=1))
    prompt = cpu.tokenizer.encode(PROMPT)
    ref_tokens, ref_lp = greedy(cpu, prompt)
    cpu.close()
    engine = load(packed, dtype="float32", cache_size="all")
    uses = triton_layers(engine)
    assert uses and all(uses)
    tokens, lp = greedy(engine, prompt)
    engine.close()
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_for_every_cache_size_graphs_on_or_off_and_device_driven(family, tiny_packed_model):
    # 4 MoE layers of 8 experts: 16 slots hold half, as many as the device map needs (twice a layer's experts)
    more = {"num_hidden_layers": 4, "layer_types": None} if family == "gpt_oss" else {}
    packed = tiny_packed_model(family, "q4", dtype="bfloat16", **more)
    runs = {}
    for size, streaming, graphs in (("min", "host", True), (slots(packed, 16), "host", True),
                                    (slots(packed, 16), "device", True), (slots(packed, 20), "device", False),
                                    ("all", "auto", True), ("all", "auto", False)):
        engine = load(packed, dtype="bfloat16", cache_size=size, graphs=graphs, host_cache_size="all",
                      streaming=streaming, cpu_experts="off")
        assert all(triton_layers(engine))  # the default plan on CUDA
        runs[(size, streaming, graphs)] = greedy(engine, engine.tokenizer.encode(PROMPT))
        # the engine decides how experts stream at its first prefill (Engine.streaming)
        assert engine.streaming == ("resident" if size == "all" else streaming)
        engine.close()
    first = next(iter(runs.values()))
    assert all(value == first for value in runs.values()), runs.keys()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["all", "min"])
def test_step_of_t_tokens_equals_t_single_steps_on_cuda(family, size, tiny_packed_model):
    engine = load(tiny_packed_model(family, "q4", dtype="bfloat16"), dtype="bfloat16", cache_size=size)
    assert all(triton_layers(engine))
    prompt = engine.tokenizer.encode(PROMPT)
    draft = [5, 17, 300, 42, 9, 250, 77, 3]
    engine.prefill(prompt)
    for T in (len(draft), 3, 1):
        engine.rollback(len(prompt))
        together = engine.step(draft[:T])
        engine.rollback(len(prompt))
        assert torch.equal(together, torch.cat([engine.step([t]) for t in draft[:T]])), T
    engine.close()
