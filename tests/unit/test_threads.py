"""The default number of compute threads: free cores, less a reader core when experts stream."""
from dataclasses import replace

from moestream.engine import plan
from moestream.engine.options import EngineOptions
from moestream.format.reader import PackedModel
from moestream.engine.engine import DEMO_MODEL


def test_choose_threads():
    assert plan.choose_threads(cores=2, load=0.0, streaming=True) == 1
    assert plan.choose_threads(cores=2, load=0.0, streaming=False) == 2
    assert plan.choose_threads(cores=8, load=0.2, streaming=True) == 7
    assert plan.choose_threads(cores=8, load=2.6, streaming=True) == 4
    assert plan.choose_threads(cores=4, load=40.0, streaming=False) == 1


def test_resolve_options_is_where_the_default_is_decided(monkeypatch):
    packed = PackedModel(DEMO_MODEL)
    options = EngineOptions(device="cpu")
    monkeypatch.setattr(plan, "machine_cores_and_load", lambda: (6, 1.2))
    streamed = plan.resolve_options(packed, options, default_cache_size="30%")
    assert streamed.threads == 4 and options.threads == 0  # a copy; the caller's options are unchanged
    assert plan.resolve_options(packed, replace(options, cache_size="all")).threads == 5
    assert plan.resolve_options(packed, replace(options, threads=3)).threads == 3
