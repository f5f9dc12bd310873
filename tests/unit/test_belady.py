"""Belady's optimum in the simulator: never below a real policy, exact on a hand-made sequence."""
import numpy as np
import pytest

from moestream.sim.belady import belady
from moestream.commands.simulate import main
from moestream.sim.simulate import simulate
from moestream.experts.trace import RoutingTrace

TRACES = ["data/traces/demo-test-00-ast.npz", "data/traces/demo-test-03-plistlib.npz"]


def one_expert_trace(experts: list[int]) -> RoutingTrace:
    n = len(experts)
    return RoutingTrace(np.zeros(n, np.int16), np.arange(n, dtype=np.int32), np.array(experts, np.int16)[:, None],
                        {"num_experts": 8, "top_k": 1})


def test_the_textbook_sequence():
    # A B C A B with two slots: OPT evicts B for C (used last), then hits A; LRU hits nothing
    trace = one_expert_trace([0, 1, 2, 0, 1])
    assert (belady(trace, slots=2).hits, belady(trace, slots=2).misses) == (1, 4)
    assert simulate(trace, slots=2, policy="lru").hits == 0
    assert belady(trace, slots=3).hits == 2


@pytest.mark.parametrize("path", TRACES)
def test_no_policy_beats_the_optimum(path):
    trace = RoutingTrace.load(path)
    for slots in (8, 26, 64, 128):
        best = belady(trace, slots=slots)
        runs = {policy: simulate(trace, slots=slots, policy=policy) for policy in ("clock", "lru", "arc", "lfu")}
        assert best.hits + best.misses == runs["lru"].hits + runs["lru"].misses
        for policy, run in runs.items():
            assert best.hits >= run.hits, (slots, policy)


def test_simulate_plots(tmp_path):
    png = tmp_path / "hit.png"
    assert main([TRACES[0], "--sizes", "10%,50%", "--policies", "lru,opt", "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
