"""Qwen3-Next / Qwen3.5 through the generic CUDA decoder: gated attention and Gated DeltaNet run in
torch ops (the recurrent state read and written at the device position, so the step is captured
as a CUDA graph), the experts on the Triton kernels. Greedy tokens equal the CPU reference's in
float32, the same bits for every cache size and with graphs on or off, step(T) = T one-token
steps bit for bit, rollback / speculation / prefix reuse give a fresh run's tokens, and sequences
stepped together get the bits they get alone."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.engine.speculative import Drafter, SpeculativeOptions
from tiny import TOKENIZER_TEXT

pytestmark = pytest.mark.gpu
FAMILIES = ["qwen3_next", "qwen3_5_moe"]
STEPS = 32


def load(packed, *, graphs=True, **opts):
    return Engine.load(packed, options=EngineOptions(**{"device": "cuda", "max_context": 256, **opts}), graphs=graphs)


class Oracle(Drafter):
    """Drafts the plain output, wrong at index `wrong_at` of each draft (kept and rejected drafts)."""

    name = "oracle"

    def __init__(self, prompt, plain, wrong_at):
        self.full, self.wrong_at = list(prompt) + list(plain), wrong_at

    def propose(self, context, k):
        out = self.full[len(context):len(context) + k]
        if len(out) > self.wrong_at:
            out[self.wrong_at] = (out[self.wrong_at] + 1) % 300
        return out


def long_prompt(engine):
    return engine.tokenizer.encode(" ".join(TOKENIZER_TEXT))  # > 3 snapshots: the chunked prefill form


def greedy(engine, prompt, steps=STEPS, **kwargs):
    events = list(engine.generate(prompt, max_new_tokens=steps, logprobs=1, stop_at_eos=False, **kwargs))
    return [e.token_id for e in events], [e.logprob for e in events]


@pytest.mark.parametrize("family", FAMILIES)
def test_decodes_like_the_cpu_reference(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    cpu = Engine.load(packed, options=EngineOptions(device="cpu", threads=1))
    prompt = long_prompt(cpu)
    ref_tokens, ref_lp = greedy(cpu, prompt)
    cpu.close()
    engine = load(packed, dtype="float32", cache_size="all")
    assert all(engine.experts.uses_triton(i, engine.dtype) for i in engine.args.moe_layers())
    tokens, lp = greedy(engine, prompt)
    assert engine.decoder.use_graphs and ("step", 1) in engine.decoder.graphs  # the whole step one graph
    engine.close()
    assert tokens == ref_tokens
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-3


@pytest.mark.parametrize("family", FAMILIES)
def test_same_bits_for_every_cache_size_and_graphs_on_or_off(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    runs = {}
    for size, graphs in (("min", True), ("50%", True), ("all", True), ("all", False)):
        engine = load(packed, dtype="bfloat16", cache_size=size, graphs=graphs)
        runs[(size, graphs)] = greedy(engine, long_prompt(engine))
        engine.close()
    first = next(iter(runs.values()))
    for key, value in runs.items():
        assert value == first, key


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("size", ["all", "min"])
def test_step_of_t_tokens_equals_t_single_steps(family, size, tiny_packed_model):
    engine = load(tiny_packed_model(family, "q4", dtype="bfloat16"), dtype="bfloat16", cache_size=size)
    prompt = long_prompt(engine)
    draft = [5, 17, 300, 42, 9, 250, 77, 3, 11, 12, 13, 14, 15, 16, 18, 19]  # a whole decoder step
    engine.prefill(prompt)
    for T in (len(draft), 3, 1):
        engine.rollback(len(prompt))
        together = engine.step(draft[:T])
        engine.rollback(len(prompt))
        assert torch.equal(together, torch.cat([engine.step([t]) for t in draft[:T]])), T
    engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_rollback_speculation_and_prefix_reuse_give_a_fresh_runs_tokens(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    engine = load(packed, dtype="float32", cache_size="all")
    prompt = long_prompt(engine)
    plain, plain_lp = greedy(engine, prompt)
    # rollback within the last steps: the same bits; further back: recomputed from a snapshot
    engine.rollback(len(prompt) + 4)
    assert greedy(engine, prompt + plain[:4], STEPS - 4)[0] == plain[4:]
    engine.rollback(len(prompt) - 9)
    tokens, lp = greedy(engine, prompt)
    assert tokens == plain and max(abs(a - b) for a, b in zip(lp, plain_lp)) < 1e-4
    # speculation with drafts kept and rejected: the plain tokens and log-probabilities
    spec = SpeculativeOptions(drafter=Oracle(prompt, plain, 2), draft_tokens=5)
    engine.reset()
    assert greedy(engine, prompt, speculative=spec) == (plain, plain_lp)
    # a prompt that leaves the cached one mid-way: reused from a snapshot, a fresh run's tokens
    other = prompt[:2 * engine.cache.book.every + 5] + prompt[:20]
    reused = greedy(engine, other)
    engine.reset()
    fresh = greedy(engine, other)
    assert reused[0] == fresh[0] and max(abs(a - b) for a, b in zip(reused[1], fresh[1])) < 1e-4
    engine.close()


@pytest.mark.parametrize("family", FAMILIES)
def test_sequences_stepped_together_get_their_bits_alone(family, tiny_packed_model):
    packed = tiny_packed_model(family, "q4", dtype="bfloat16")
    engine = load(packed, dtype="bfloat16", cache_size="all", max_sequences=2)
    prompt = long_prompt(engine)
    prompts = {0: prompt, 1: prompt[:50]}
    alone = {}
    for seq, p in prompts.items():
        if seq:
            engine.open_sequence(slot=seq)
        engine.prefill(p, seq=seq)
        alone[seq] = [engine.step([t], seq=seq).clone() for t in (7, 8, 9)]
        engine.rollback(len(p), seq=seq)
    together = [engine.step_many({0: [t], 1: [t]}) for t in (7, 8, 9)]
    for i in range(3):
        for seq in prompts:
            assert torch.equal(together[i][seq], alone[seq][i]), (i, seq)
    engine.close()
