"""The engine on CUDA: exact against transformers in float32, bf16 within tolerance, and the same
tokens for every cache size, source and host tier."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.convert.export_hf import export_hf

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
# bf16 against the float32 reference: the largest log-probability difference over the prompt
BF16_LOGPROB_TOLERANCE = 0.15


def reference(folder, dtype=torch.float32):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, attn_implementation="eager", experts_implementation="eager",
                                                dtype=dtype).to("cuda").eval()


def greedy(ref, prompt, steps, eos):
    seq, out = list(prompt), []
    with torch.no_grad():
        for _ in range(steps):
            t = int(ref(torch.tensor([seq], device="cuda")).logits[0, -1].argmax())
            if t in eos:
                break
            out.append(t)
            seq.append(t)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_on_cuda_matches_transformers(family, tiny_checkpoint, tiny_packed_model):
    engine = Engine.load(tiny_packed_model(family, "none"), options=EngineOptions(device="cuda", dtype="float32"))
    ref = reference(tiny_checkpoint(family))
    prompt = engine.tokenizer.encode("def fibonacci(n):\n    return")
    logits, _ = engine.prefill(prompt, all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt], device="cuda")).logits[0].float().log_softmax(-1)
    assert (logits.log_softmax(-1) - expected).abs().max().item() < 1e-4
    tokens = [e.token_id for e in engine.generate(prompt, max_new_tokens=24)]
    assert tokens == greedy(ref, prompt, 24, engine.tokenizer.eos_token_ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_q4_bf16_on_cuda_is_close_to_float32_reference(family, tiny_packed_model, tmp_path):
    packed = tiny_packed_model(family, "q4")
    engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype="bfloat16"))
    ref = reference(export_hf(packed, tmp_path / "hf"))
    prompt = engine.tokenizer.encode("import os\nclass Thing:\n    def")
    logits, _ = engine.prefill(prompt, all_logits=True)
    with torch.no_grad():
        expected = ref(torch.tensor([prompt], device="cuda")).logits[0].float().log_softmax(-1)
    assert (logits.log_softmax(-1) - expected).abs().max().item() < BF16_LOGPROB_TOLERANCE


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_same_tokens_for_every_cache_size_source_and_host_tier_on_cuda(tiny_packed_model, dtype):
    packed = tiny_packed_model("qwen3_moe", "q4")
    runs = {}
    for size in ["min", "25%", "50%", "all"]:
        for source in ["direct", "mmap"]:
            for host in ["0", "all"]:
                engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype=dtype, cache_size=size,
                                                                   expert_source=source, host_cache_size=host,
                                                                   prefill_chunk_tokens=5, cpu_experts="off"))
                prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
                events = list(engine.generate(prompt, max_new_tokens=16, logprobs=3))
                runs[(size, source, host)] = [(e.token_id, e.top_logprobs) for e in events]
                engine.close()
    first = next(iter(runs.values()))
    for key, value in runs.items():
        assert [t for t, _ in value] == [t for t, _ in first], key
        for (_, a), (_, b) in zip(value, first):  # same kernels on the same bytes: same numbers
            assert a == b, key


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_gives_the_same_bits_with_or_without_graphs_resident_or_streamed(tiny_packed_model, dtype):
    """300 tokens through the CUDA decoder: with CUDA graphs or
    eagerly, every expert resident (one graph per step) or streamed through half the slots (a sync
    per layer). Same kernels on the same bytes: the same tokens and the same log-probabilities."""
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")  # bf16 scales: the Triton path
    outs = {}
    for graphs, size in ((True, "50%"), (False, "50%"), (True, "all"), (False, "all")):
        engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype=dtype,
                                                           max_context=1024, cache_size=size), graphs=graphs)
        assert engine.decoder is not None and engine.decoder.use_graphs == graphs
        prompt = engine.tokenizer.encode("def fibonacci(n):\n    if n < 2:")
        outs[(graphs, size)] = [(e.token_id, e.logprob) for e in
                                engine.generate(prompt, max_new_tokens=300, logprobs=1, stop_at_eos=False)]
        assert engine.decoder.resident == (size == "all")
        engine.close()
    first = outs[(True, "50%")]
    assert len(first) == 300
    for key, value in outs.items():
        assert value == first, key
