"""The simulator replays a trace exactly as the engine's cache decides."""
import json

import numpy as np

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.commands.simulate import main as simulate_main
from moestream.sim.simulate import simulate, simulate_device
from moestream.experts.trace import RoutingTrace


def test_simulated_hit_counts_equal_the_engine_decode_counts(tiny_packed_model, tmp_path):
    model = tiny_packed_model("qwen3_moe", "q4")
    path = tmp_path / "t.npz"
    # one token at a time, so the engine asks for exactly one token's experts per layer, as replayed;
    # reads on demand only, as the simulator replays them (no next-layer guesses)
    engine = Engine.load(model, options=EngineOptions(device="cpu", cache_size="40KiB", prefill_chunk_tokens=1,
                                                      cache_policy="lru", trace_routing=str(path)), prefetch=False)
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


def uniform_trace(layers: int, experts: int, picks: int, tokens: int, seed: int = 0) -> RoutingTrace:
    """Every token visits every layer in order, picking `picks` distinct experts uniformly."""
    rng = np.random.default_rng(seed)
    rows = [rng.choice(experts, picks, replace=False) for _ in range(tokens * layers)]
    layer = np.tile(np.arange(layers, dtype=np.int16), tokens)
    position = np.repeat(np.arange(tokens, dtype=np.int32), layers)
    return RoutingTrace(layer, position, np.stack(rows).astype(np.int16), {"num_experts": experts})


def test_device_lru_is_plain_lru():
    # one expert a lookup (two in one lookup share a stamp, and the map then breaks the tie by slot):
    # the device map's LRU victims are the host cache's
    trace = uniform_trace(layers=4, experts=16, picks=1, tokens=300)
    for slots in (32, 40, 56):
        device = simulate_device(trace, slots=slots, policy="device-lru")
        host = simulate(trace, slots=slots, policy="lru")
        assert (device.hits, device.misses) == (host.hits, host.misses)


def test_device_cycle_beats_lru_when_layers_come_round_in_turn():
    # uniform routing over many layers: LRU evicts the layer that comes next; the cycle rule keeps
    # it and so hits about the cache's share (LRU falls well below it)
    trace = uniform_trace(layers=8, experts=16, picks=2, tokens=200)
    slots = 32  # 25 % of 128
    cycle = simulate_device(trace, slots=slots, policy="device-cycle")
    lru = simulate_device(trace, slots=slots, policy="device-lru")
    assert cycle.hits + cycle.misses == lru.hits + lru.misses == 8 * 200 * 2
    assert cycle.hit_rate > lru.hit_rate + 0.01
    assert cycle.hit_rate > 0.25 - 0.03


def test_simulate_command_reports_device_policies(tmp_path, capsys):
    path = tmp_path / "u.npz"
    uniform_trace(layers=4, experts=16, picks=2, tokens=50).save(path)
    assert simulate_main([str(path), "--sizes", "50%", "--policies", "device-cycle,device-lru", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in rows] == ["device-cycle", "device-lru"]
    assert all(r["slots"] == 32 and r["hits"] + r["misses"] == 4 * 50 * 2 for r in rows)
    # 25 % is 16 slots, below the map's minimum (twice a layer's 16 experts): that row is skipped, said
    # why, and the others stand
    assert simulate_main([str(path), "--sizes", "25%,50%", "--policies", "lru,device-cycle", "--json"]) == 0
    captured = capsys.readouterr()
    assert [(r["size"], r["policy"]) for r in json.loads(captured.out)] == [
        ("25%", "lru"), ("50%", "lru"), ("50%", "device-cycle")]
    assert "skipped: device-cycle at 16 slots" in captured.err and "needs at least 32" in captured.err
