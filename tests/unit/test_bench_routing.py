"""Benchmark routing: replacements after the router at a known distribution, never in generate."""
import numpy as np
import pytest
import torch

from moestream.bench.routing import Rerouter, RoutingSpec, parse_routing
from moestream.errors import MoestreamError
from moestream.experts.trace import RoutingTrace

TRACE = "data/traces/demo-test-00-ast.npz"


def test_parse_routing():
    assert parse_routing("uniform").kind == "uniform"
    z = parse_routing("zipf:1.2")
    assert (z.kind, z.skew, z.locality) == ("zipf", 1.2, 1.0)
    assert parse_routing("zipf:0.5:3").locality == 3.0
    assert parse_routing("trace:x.npz").trace == "x.npz"
    for bad in ("random", "zipf", "zipf:a", "zipf:-1", "zipf:1:2:3", "trace:", "uniform:2"):
        with pytest.raises(MoestreamError):
            parse_routing(bad)


def draws(spec, steps=3000, E=32, A=4, T=1):
    r = Rerouter(spec, [0], E, A, device=torch.device("cpu"), seed=1)
    w = torch.ones(T, A)
    return torch.stack([r(0, w, torch.zeros(T, A, dtype=torch.long))[1] for _ in range(steps)])  # [steps, T, A]


def test_uniform_draws_distinct_experts_evenly():
    ids = draws(RoutingSpec("uniform"))
    assert all(len(set(row)) == 4 for row in ids.view(-1, 4).tolist())
    counts = torch.bincount(ids.view(-1), minlength=32).float()
    expected = ids.numel() / 32
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 70  # 31 degrees of freedom: p < 1e-4 beyond this


def test_zipf_skews_towards_top_ranks_and_locality_repeats_experts():
    flat = draws(RoutingSpec("zipf", skew=1.5, locality=0.0)).view(-1)
    counts = np.sort(torch.bincount(flat, minlength=32).numpy())[::-1]
    assert counts[:4].sum() > 0.3 * flat.numel()  # the top ranks take far more than 4/32 of the draws

    def repeats(locality):
        ids = draws(RoutingSpec("zipf", skew=0.5, locality=locality), steps=800).view(-1, 4).tolist()
        return np.mean([len(set(a) & set(b)) for a, b in zip(ids, ids[1:])])
    assert repeats(4.0) > repeats(0.0) + 1.0


def test_trace_replay_gives_the_trace_and_tiles_onto_larger_shapes():
    trace = RoutingTrace.load(TRACE)
    layer0 = trace.experts[trace.layer == 0]
    same = Rerouter(RoutingSpec("trace", trace=TRACE), [0], 32, 4, device=torch.device("cpu"))
    got = torch.cat([same(0, torch.ones(2, 4), torch.zeros(2, 4, dtype=torch.long)) [1] for _ in range(3)])
    assert got.tolist() == layer0[:6].tolist()  # position by position, across calls
    big = Rerouter(RoutingSpec("trace", trace=TRACE), list(range(12)), 128, 8, device=torch.device("cpu"))
    ids = big(9, torch.ones(1, 8), torch.zeros(1, 8, dtype=torch.long))[1][0].tolist()
    layer1 = trace.experts[trace.layer == 1][0].tolist()  # model layer 9 replays trace layer 9 mod 8
    assert ids == [e + 32 * 1 for e in layer1] + [e + 32 * 2 for e in layer1]
    with pytest.raises(MoestreamError):
        Rerouter(RoutingSpec("trace", trace=TRACE), [0], 48, 6, device=torch.device("cpu"))


def test_bench_json_names_the_routing_and_generate_never_reroutes(tmp_path):
    import json

    from moestream.commands.bench import main
    from moestream.engine.engine import Engine
    from moestream.engine.options import EngineOptions

    out = tmp_path / "b.json"
    assert main(["--routing", "uniform", "--prefill-tokens", "16", "--decode-tokens", "8", "--threads", "1",
                 "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["routing"] == "uniform"
    assert result["runs"][0]["decode"]["hit_rate"] < 0.6  # the demo's own routing hits far more at 30 %
    engine = Engine.load(options=EngineOptions(device="cpu", threads=1))
    assert engine.experts.reroute is None
    engine.close()
