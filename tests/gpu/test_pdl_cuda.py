"""Programmatic dependent launch on CUDA (moestream.kernels.pdl): the decode step's Triton kernels
launched with PDL give the bits of the same kernels launched without it, eagerly and replayed in the
step's CUDA graph, at every cache size; and the kernels really are launched with it on this GPU."""
import dataclasses

import pytest
import torch

from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.kernels import pdl

from batching_helpers import greedy_rows

pytestmark = pytest.mark.gpu


@pytest.fixture
def pdl_off(monkeypatch):
    def off():
        monkeypatch.setattr(pdl, "DEFAULT_CONFIG", dataclasses.replace(pdl.DEFAULT_CONFIG, pdl=0))
    return off


def test_pdl_is_on_for_this_gpu():
    x = torch.zeros(1, device="cuda")
    assert pdl.pdl_launch(x) == ({"PDL": True, "launch_pdl": True} if torch.cuda.get_device_capability()[0] >= 9
                                 else {"PDL": False})
    assert pdl.pdl_launch(torch.zeros(1)) == {"PDL": False}


def test_a_split_product_with_pdl_gives_the_bits_without(pdl_off):
    from moestream.kernels.triton_rows import tile_linear

    g = torch.Generator(device="cuda").manual_seed(3)
    x = torch.randn(16, 4096, device="cuda", generator=g).to(torch.bfloat16)
    w = (torch.randn(2048, 4096, device="cuda", generator=g) / 64).to(torch.bfloat16)
    with_pdl = [tile_linear(x, w) for _ in range(3)]  # back to back: each launch overlaps the one before
    pdl_off()
    without = tile_linear(x, w)
    assert all(torch.equal(y, without) for y in with_pdl)


@pytest.mark.parametrize("cache_size", ["all", "50%"])
def test_greedy_decode_with_pdl_gives_the_bits_without(tiny_packed_model, pdl_off, cache_size):
    packed = tiny_packed_model("qwen3_moe", "q4", dtype="bfloat16")
    runs = []
    for _ in range(2):
        engine = Engine.load(packed, options=EngineOptions(device="cuda", dtype="bfloat16", max_context=256,
                                                           cache_size=cache_size))
        try:
            runs.append(greedy_rows(engine, [t % engine.args.vocab_size for t in range(5, 60)], 24))
        finally:
            engine.close()
        pdl_off()
    (tokens, rows), (ref_tokens, ref_rows) = runs
    assert tokens == ref_tokens
    assert all(torch.equal(a, b) for a, b in zip(rows, ref_rows))
