"""A short prompt run inside another sequence's decode step (Engine.prompt_step, how the batch
scheduler's newcomers join a step on CUDA) gives the bits its own prefill gives, and its decoding
goes on with the same bits."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("cache_size", ["all", "50%"])
def test_a_prompt_in_a_shared_step_equals_its_own_prefill(cache_size, tiny_packed_model):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype="bfloat16", max_context=256,
                                                       cache_size=cache_size, max_sequences=2))
    try:
        for seq in list(engine.open_sequences):  # slots are opened here, by number
            engine.close_sequence(seq)
        tok = engine.tokenizer
        running, newcomer = tok.encode("def fibonacci(n):"), tok.encode("The quick brown fox")[:10]
        assert 2 <= len(newcomer) <= 12
        # alone: the newcomer's prefill in slot 1, then two decode steps
        engine.open_sequence(newcomer, slot=1)
        alone = [engine.prefill(newcomer, seq=1)[0][-1].clone()]
        for _ in range(2):
            alone.append(engine.step([int(alone[-1].argmax())], seq=1)[-1].clone())
        engine.close_sequence(1)
        # together: slot 0 decodes while the newcomer's prompt joins its step in slot 1
        engine.open_sequence(running, slot=0)
        first = engine.prefill(running, seq=0)[0][-1]
        engine.open_sequence([], slot=1)  # an emptied slot: nothing of the prompt is reused
        assert engine.prompt_step(newcomer, seq=1, beside=17 - len(newcomer)) is None  # no room
        assert engine.prompt_step(list(range(1, 18)), seq=1, beside=0) is None  # more than a step's rows
        tokens = engine.prompt_step(newcomer, seq=1, beside=1)
        assert tokens == newcomer
        out = engine.step_many({0: [int(first.argmax())], 1: tokens})
        together = [out[1][-1]]
        for _ in range(2):
            out = engine.step_many({0: [int(out[0][-1].argmax())], 1: [int(together[-1].argmax())]})
            together.append(out[1][-1])
        for i, (a, b) in enumerate(zip(alone, together)):
            assert torch.equal(a, b), f"position {i}: the shared step's bits differ from the prefill's"
    finally:
        engine.close()
