"""A prefill's transient device memory is kept for the next prompt without a memory budget and given
back after each prefill under one, and the logits are the same bits either way."""
import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("budget,released", [(None, False), ("6GiB", True)])
def test_the_workspace_is_kept_or_given_back(budget, released, tiny_packed_model, monkeypatch):
    import moestream.engine.engine as engine_module

    monkeypatch.setattr(engine_module, "WORKSPACE_SLACK", -1)  # the tiny model's workspace is small
    # (no prefill graphs: torch.cuda.graph empties the cache itself before a capture)
    emptied = []
    empty_cache = torch.cuda.empty_cache
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: (emptied.append(1), empty_cache()))
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype="bfloat16", max_context=1024,
                                                       cache_size="all",
                                                       memory_budget=budget))
    engine.prefill_graphs = None
    try:
        vocab = engine.args.vocab_size
        prompt = [3 + i % (vocab - 3) for i in range(697)]  # token ids the model has
        logits = engine.prefill(prompt)[0].clone()
        assert bool(emptied) == released
        engine.reset()
        assert torch.equal(engine.prefill(prompt)[0], logits)  # a kept workspace changes no bits
    finally:
        engine.close()
