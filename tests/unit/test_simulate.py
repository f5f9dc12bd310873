"""The simulator replays a trace exactly as the engine's cache decides."""
import numpy as np

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.sim.simulate import simulate
from moestream.sim.trace import RoutingTrace


def test_simulated_hit_counts_equal_the_engine_decode_counts(tiny_packed_model, tmp_path):
    model = tiny_packed_model("qwen3_moe", "q4")
    path = tmp_path / "t.npz"
    # one token at a time, so the engine asks for exactly one token's experts per layer, as replayed;
    # reads on demand only, as the simulator replays them (no next-layer guesses)
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="40KiB", prefill_chunk_tokens=1,
                                                      cache_policy="lru", trace_routing=str(path), prefetch="none"))
    list(engine.generate(engine.tokenizer.encode("def fibonacci(n):"), max_new_tokens=20))
    stats = engine.provider.stats()
    trace = RoutingTrace.load(path)
    sim = simulate(trace, slots=5, policy="lru")
    assert (sim.hits, sim.misses) == (stats["hits"], stats["misses"])


def test_bigger_cache_never_hits_less_under_lru():
    rng = np.random.default_rng(0)
    n = 400
    experts = np.stack([rng.choice(16, 2, replace=False) for _ in range(n)]).astype(np.int16)
    trace = RoutingTrace(np.zeros(n, np.int16), np.arange(n, dtype=np.int32), experts, {"num_experts": 16})
    rates = [simulate(trace, slots=s, policy="lru").hit_rate for s in (2, 4, 8, 16)]
    assert rates == sorted(rates) and rates[-1] > 0.9
