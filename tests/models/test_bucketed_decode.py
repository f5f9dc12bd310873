"""The one-token step that CUDA graphs replay (device position, masked attention over a key-length
bucket) computes what the plain step computes. Checked eagerly on the CPU; tests/gpu checks the
captured graphs."""
import torch

from moestream.engine import cuda_graphs
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions


class EagerSteps(cuda_graphs.DecodeGraphs):
    """The graph path's computation, run without capturing (CUDA graphs need a GPU)."""

    def __init__(self, model, cache):
        hidden = model.embed.shape[1]
        self.model, self.cache = model, cache
        self.x = torch.zeros((1, hidden), dtype=model.dtype)
        self.pos = torch.zeros(1, dtype=torch.long)
        self.bucket = cuda_graphs.MIN_BUCKET

    def attention_half(self, layer, x):
        self.x.copy_(x)
        return self._run(layer, self.bucket)


def test_bucketed_masked_step_matches_the_plain_step(tiny_packed_model, monkeypatch):
    monkeypatch.setattr(cuda_graphs, "MIN_BUCKET", 16)  # cross bucket boundaries within a short run
    model = tiny_packed_model("qwen3_moe", "q4")
    plain = Engine.load(model, options=EngineOptions(device="cpu", max_context=64))
    stepped = Engine.load(model, options=EngineOptions(device="cpu", max_context=64))
    stepped.graphs = EagerSteps(stepped.model, stepped.cache)
    prompt = plain.tokenizer.encode("def fibonacci(n):")
    a = list(plain.generate(prompt, max_new_tokens=40, logprobs=2))
    b = list(stepped.generate(prompt, max_new_tokens=40, logprobs=2))
    assert [e.token_id for e in a] == [e.token_id for e in b]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-4
    assert stepped.graphs.bucket == 64  # the last steps ran with the cache's full length as bucket
