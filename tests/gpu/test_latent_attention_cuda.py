"""Latent-attention families on CUDA through the generic decoder: greedy tokens equal to the CPU
reference (float32, whole steps captured as graphs), bf16 log-probabilities within the decoder's
tolerance, and step(T tokens) = T one-token steps bit for bit.

bf16 rounding flips near-tied choices of the tiny random routers (kimi_k25's has two expert groups
3e-6 apart at its third step); from such a flip on, bf16 and the reference compute different
experts. Where bf16 routed otherwise, its log-probabilities are compared with the float32 reference
routed as bf16 routed (the same experts, the router's own weights), so every step is compared; a
routing defect, not a flipped tie, shows as many flips."""
import pytest
import torch

from gpu.test_decoder import BF16_LOGPROB_TOLERANCE, PROMPT, STEPS, forced_logprobs, greedy_with_logprobs, load
from routing_compare import flips, route_as, routing

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu
FAMILIES = ["deepseek_v3", "glm4_moe_lite", "kimi_k25"]


@pytest.mark.parametrize("family", FAMILIES)
def test_latent_attention_decodes_on_cuda_like_the_cpu(family, tiny_packed_model, tmp_path):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    cpu = Engine.load(packed, options=EngineOptions(device="cpu", threads=1, trace_routing=str(tmp_path / "cpu.npz")))
    prompt = cpu.tokenizer.encode(PROMPT)
    ref_tokens, ref_lp = greedy_with_logprobs(cpu, prompt, STEPS)
    ref_routing = routing(cpu)
    cpu.close()

    fp32 = load(packed, dtype="float32", cache_size="all")
    tokens, lp = greedy_with_logprobs(fp32, prompt, STEPS)
    assert ("step", 1) in fp32.decoder.graphs  # the whole step ran as one captured graph
    fp32.close()
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3

    bf16 = load(packed, dtype="bfloat16", cache_size="50%", trace_routing=str(tmp_path / "bf16.npz"))
    forced = forced_logprobs(bf16, prompt, ref_tokens)
    bf16_routing = routing(bf16)
    flipped = flips(ref_routing, bf16_routing)
    assert len(flipped) <= len(ref_routing) // 10, f"bf16 routed unlike the reference at {flipped}"
    if flipped:
        cpu = Engine.load(packed, options=EngineOptions(device="cpu", threads=1))
        route_as(cpu, bf16_routing)
        ref_lp = forced_logprobs(cpu, prompt, ref_tokens)
        cpu.close()
    assert max(abs(a - b) for a, b in zip(forced, ref_lp)) < BF16_LOGPROB_TOLERANCE, flipped
    bf16.reset()
    bf16.prefill(prompt)
    draft = [5, 17, 300, 42, 9]
    together = bf16.step(draft).clone()
    bf16.rollback(len(prompt))
    assert torch.equal(together, torch.cat([bf16.step([t]).clone() for t in draft]))
    bf16.close()
