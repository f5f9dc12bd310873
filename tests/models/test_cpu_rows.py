"""The CPU's faster steps give the bits of the row-by-row reference they replace: a step's rows
through each layer's attention half and the head at once (Decoder step_rows, rows_head), and, where
the torch reference computes the experts (records the native kernels do not take), kept unpacked
experts, a step's expert pairs batched (TorchPlan._run_rows) and codes read through bytes. The
reference is the same engine with each of these turned off; the logits of every step and the
tokens of greedy, sampled and speculative decoding must be identical, at every cache size."""
import pytest
import torch

from moestream.engine.decoder import Decoder
from moestream.engine.engine import DEMO_MODEL, Engine
from moestream.engine.options import EngineOptions
from moestream.engine.speculative import NGramDrafter, SpeculativeOptions
from moestream.engine.types import SamplingParams
from moestream.layers.torch_experts import TorchPlan
from moestream.layers.transformer import MoETransformer
from moestream.quant import affine

PROMPT = "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
SAMPLED = SamplingParams(temperature=0.8, top_k=50, seed=7)


def load(packed, cache_size, *, prefetch=True, **opts):
    return Engine.load(packed, options=EngineOptions(device="cpu", threads=1, cache_size=cache_size, **opts),
                       prefetch=prefetch)


_step_rows = Decoder.step_rows


def one_row_at_a_time(self, tokens, positions, slots, *, head=True, device_tokens=None):
    """The reference of a step of several rows: each row a step of its own."""
    if device_tokens is not None:  # one row whose token is still on the device (plain greedy decoding)
        return _step_rows(self, tokens, positions, slots, head=head, device_tokens=device_tokens)
    return torch.cat([_step_rows(self, [t], [p], [s], head=head).clone() for t, p, s in zip(tokens, positions, slots)])


@pytest.fixture
def row_by_row(monkeypatch):
    """Turns every new piece off: what the CPU computed before (pass the engine to `apply`)."""
    def apply(engine):
        monkeypatch.setattr(TorchPlan, "_rows_at_once", lambda self: False)
        monkeypatch.setattr(MoETransformer, "rows_head",
                            lambda self, x: torch.cat([self.head(x[t:t + 1]) for t in range(x.shape[0])]))
        monkeypatch.setattr(affine, "float_codes", lambda w, bits: affine.unpack(w, bits).to(torch.float32))
        monkeypatch.setattr(Decoder, "step_rows", one_row_at_a_time)
        engine.experts.unpacked = None
        return engine
    return apply


def steps(engine, prompt):
    """Logits of a prefill and of steps of 1..8 rows (rolled back) and one-token steps."""
    engine.reset()
    out = [engine.prefill(prompt)[0]]
    base = engine.cache.length
    draft = prompt[-8:]
    for T in (2, 3, 5, 8):
        out.append(engine.step(draft[:T]).clone())
        engine.rollback(base)
    out += [engine.step([t]).clone() for t in draft]
    return out


def decode(engine, prompt, sampling, speculative=None, n=40):
    engine.reset()
    return [e.token_id for e in engine.generate(prompt, max_new_tokens=n, sampling=sampling, stop_at_eos=False,
                                                speculative=speculative)]


@pytest.mark.parametrize("cache_size", ["100%", "25%"])
def test_demo_model_gives_the_row_by_row_bits(cache_size, row_by_row):
    fast = load(DEMO_MODEL, cache_size)
    assert all(layout is not None for layout in fast.experts.native.values())  # the native experts run here
    prompt = fast.tokenizer.encode(PROMPT)
    fast_logits = steps(fast, prompt)
    fast_tokens = [decode(fast, prompt, s) for s in (SamplingParams(), SAMPLED)]
    spec = [decode(fast, prompt, s, SpeculativeOptions(drafter=NGramDrafter())) for s in (SamplingParams(), SAMPLED)]
    fast.close()

    slow = row_by_row(load(DEMO_MODEL, cache_size))
    slow_logits = steps(slow, prompt)
    slow_tokens = [decode(slow, prompt, s) for s in (SamplingParams(), SAMPLED)]
    slow.close()
    assert len(fast_logits) == len(slow_logits)
    for a, b in zip(fast_logits, slow_logits):
        assert torch.equal(a, b)  # bit for bit
    assert fast_tokens == slow_tokens
    assert spec == slow_tokens  # speculative = plain, greedy and sampled
    assert fast_tokens[0] != fast_tokens[1]  # sampling really sampled


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "gpt_oss", "gemma4_text", "qwen3_next", "deepseek_v3"])
def test_tiny_families_give_the_row_by_row_bits(family, tiny_packed_model, row_by_row):
    packed = tiny_packed_model(family, "q4")
    fast = load(packed, "100%", prefetch=False)
    prompt = fast.tokenizer.encode(PROMPT)
    fast_logits = steps(fast, prompt)
    fast.close()
    slow = row_by_row(load(packed, "100%", prefetch=False))
    slow_logits = steps(slow, prompt)
    slow.close()
    for a, b in zip(fast_logits, slow_logits):
        assert torch.equal(a, b)


@pytest.mark.parametrize("cache_size", ["100%", "25%"])
def test_unquantized_records_give_the_row_by_row_bits(cache_size, tiny_packed_model, row_by_row):
    """Records the native kernels do not take: the torch reference's own faster pieces run."""
    packed = tiny_packed_model("qwen3_moe", "none")
    fast = load(packed, cache_size, prefetch=False)
    assert fast.experts.unpacked is not None and all(layout is None for layout in fast.experts.native.values())
    prompt = fast.tokenizer.encode(PROMPT)
    fast_logits = steps(fast, prompt)
    kept = fast.expert_stats()
    assert kept["unpacked_hits"] > 0 and kept["unpacked_experts"] <= fast.plan.slots
    fast.close()
    slow = row_by_row(load(packed, cache_size, prefetch=False))
    slow_logits = steps(slow, prompt)
    slow.close()
    for a, b in zip(fast_logits, slow_logits):
        assert torch.equal(a, b)
