"""The generic decoder on CUDA for every family: the Triton expert kernels and fused attention
kernels (not a fallback), greedy tokens equal to the torch reference, bf16 log-probabilities within
tolerance where bf16 routes like the reference, the same bits for every cache size, and
step(T tokens) = T one-token steps bit for bit."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from routing_compare import flips, routing, steps_routed_alike

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"]
PROMPT = "def fibonacci(n):\n    if n < 2:"
STEPS = 32
# bf16 against the float32 reference, teacher-forced on the reference's tokens: the largest
# log-probability difference of the chosen token (the README states the same figure)
BF16_LOGPROB_TOLERANCE = 0.15
# Tiny random models have near-tied router scores (glm4_moe's groups of two experts differ by 1e-3):
# bf16 rounding flips such a tie, a token then takes another expert, and every later step moves by
# up to 0.4. Steps are compared up to the first flip (a flip in the last layer moves only its own
# position: minimax_m2's prompt has one 2e-4 from a tie there, bf16 noise is 2e-3); this many at least.
MIN_AGREED_STEPS = STEPS // 4


def load(packed, *, graphs=True, prefetch=True, **opts):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "max_context": 256, **opts}), graphs=graphs,
                       prefetch=prefetch)


def greedy_with_logprobs(engine, prompt, steps):
    events = list(engine.generate(prompt, max_new_tokens=steps, logprobs=1, stop_at_eos=False))
    return [e.token_id for e in events], [e.logprob for e in events]


def forced_logprobs(engine, prompt, tokens):
    """Log-probability of each of `tokens` fed one step at a time after the prompt."""
    logits, _ = engine.prefill(prompt)
    out = []
    for t in tokens:
        out.append(float(torch.log_softmax(logits[-1].float(), -1)[t]))
        logits = engine.step([t])
    return out


def greedy_or_forced(engine, prompt, steps, forced=None):
    """(tokens, log-probabilities): `steps` greedy tokens, or with `forced` those tokens fed one step at a time."""
    if forced is None:
        return greedy_with_logprobs(engine, prompt, steps)
    return forced, forced_logprobs(engine, prompt, forced)


def takes_the_fast_path(engine):
    layers = engine.args.moe_layers()
    return layers and all(engine.experts.uses_triton(i, engine.dtype) for i in layers)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_decodes_through_the_decoder_like_the_reference(family, tiny_packed_model, tmp_path):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")  # bf16 scales, 4-bit: the Triton layout
    cpu = Engine.load(packed, options=EngineOptions(device="cpu", threads=1, trace_routing=str(tmp_path / "cpu.npz")))
    prompt = cpu.tokenizer.encode(PROMPT)
    ref_tokens, ref_lp = greedy_with_logprobs(cpu, prompt, STEPS)
    ref_routing = routing(cpu)
    cpu.close()

    fp32 = load(packed, dtype="float32", cache_size="all")
    assert takes_the_fast_path(fp32), "the Triton expert kernels were not taken"
    tokens, lp = greedy_with_logprobs(fp32, prompt, STEPS)
    assert fp32.decoder.use_graphs and fp32.decoder.resident
    assert ("step", 1) in fp32.decoder.graphs  # the whole step ran as one captured graph
    fp32.close()
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3

    bf16 = load(packed, dtype="bfloat16", cache_size="50%", trace_routing=str(tmp_path / "bf16.npz"))
    assert takes_the_fast_path(bf16)
    forced = forced_logprobs(bf16, prompt, ref_tokens)
    assert not bf16.decoder.resident and any(k[0] == "experts" for k in bf16.decoder.graphs)
    bf16_routing = routing(bf16)
    alike = steps_routed_alike(ref_routing, bf16_routing, len(prompt), len(ref_tokens),
                               last_layer=bf16.args.num_hidden_layers - 1)
    bf16.close()
    assert len(alike) >= MIN_AGREED_STEPS, \
        f"bf16 routed unlike the reference: {len(alike)} steps alike, flips (position, layer) {flips(ref_routing, bf16_routing)[:8]}"
    assert max(abs(forced[j] - ref_lp[j]) for j in alike) < BF16_LOGPROB_TOLERANCE


@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_for_every_cache_size_and_graphs_on_or_off(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    runs = {}
    for size, graphs, host in (("min", True, "0"), ("50%", True, "all"), ("all", True, "0"), ("all", False, "0"),
                               ("60%", False, "all")):
        engine = load(packed, dtype="bfloat16", cache_size=size, graphs=graphs, host_cache_size=host,
                      cpu_experts="off")
        prompt = engine.tokenizer.encode(PROMPT)
        runs[(size, graphs, host)] = greedy_with_logprobs(engine, prompt, STEPS)
        engine.close()
    first = next(iter(runs.values()))
    for key, value in runs.items():
        assert value == first, key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["all", "min"])
def test_step_of_t_tokens_equals_t_single_steps_on_cuda(family, size, tiny_packed_model):
    engine = load(tiny_packed_model(family, "q4", dtype="bfloat16"), dtype="bfloat16", cache_size=size)
    prompt = engine.tokenizer.encode(PROMPT)
    draft = [5, 17, 300, 42, 9, 250, 77, 3]
    engine.prefill(prompt)
    for T in (len(draft), 3, 1):  # each T its own graphs; repeated to replay them
        engine.rollback(len(prompt))
        together = engine.step(draft[:T])
        engine.rollback(len(prompt))
        singles = torch.cat([engine.step([t]) for t in draft[:T]])
        assert torch.equal(together, singles), T
    engine.close()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_lookahead_changes_no_bits_and_reports_its_accuracy(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    outs = {}
    for prefetch in ("none", "next-layer"):
        engine = load(packed, dtype="bfloat16", cache_size="50%", prefetch=prefetch == "next-layer",
                      host_cache_size="all", cpu_experts="off")
        prompt = engine.tokenizer.encode(PROMPT)
        gen = engine.generate(prompt, max_new_tokens=STEPS, logprobs=1, stop_at_eos=False)
        outs[prefetch] = [(e.token_id, e.logprob) for e in gen]
        receipt = gen.result.receipt
        if prefetch == "none":
            assert receipt["lookahead"] == {}
        else:
            assert engine.decoder.lookahead is not None and receipt["lookahead"]["accuracy"]["depth1"] is not None
            assert receipt["experts"]["prefetch_issued"] > 0
        engine.close()
    assert outs["next-layer"] == outs["none"]
