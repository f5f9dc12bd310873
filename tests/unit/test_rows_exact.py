"""The CPU's exact batching pieces: rows_linear gives each row F.linear's one-row bits, float_codes
gives unpack's codes, the kept unpacked experts are valid only while their slot holds them, and
a quarter of the memory budget (or of free RAM) sizes them (CPU only)."""
import itertools

import pytest
import torch
import torch.nn.functional as F

from moestream.engine.options import EngineOptions
from moestream.engine.plan import unpacked_limit
from moestream.experts.unpacked import UnpackedExperts
from moestream.kernels import reference
from moestream.kernels.reference import rows_exact, rows_linear
from moestream.quant import affine


@pytest.mark.parametrize("threads", [1, 2])
def test_rows_linear_gives_every_row_its_one_row_bits(threads):
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for K, N in itertools.product((16, 64, 128, 256, 768), (16, 64, 128, 256, 2048)):
            if not rows_exact(torch.float32, K, N):
                continue
            W = torch.randn(N, K)
            for n in (1, 2, 3, 8, 16):
                x = torch.randn(2 * n, K)[::2]  # rows that are not side by side too
                alone = torch.cat([F.linear(x[i:i + 1], W) for i in range(n)])
                assert torch.equal(rows_linear(x, W).view(n, N), alone), (K, N, n)
                out = torch.empty(n, 1, N)
                rows_linear(x.contiguous(), W, out=out)
                assert torch.equal(out.view(n, N), alone)
    finally:
        torch.set_num_threads(before)


def test_rows_exact_refuses_what_torch_computes_otherwise():
    assert rows_exact(torch.float32, 256, 128)
    assert not rows_exact(torch.float32, 8, 16)  # under 400 multiply-adds: torch's own loop
    assert not rows_exact(torch.bfloat16, 256, 128)  # oneDNN
    assert not rows_exact(torch.float32, 4096, reference.PROBE_LIMIT // 4096 + 1)  # too big to check here


def test_rows_exact_checks_each_shape_on_this_machine(monkeypatch):
    """A BLAS whose batched rows round otherwise (here: one row's product nudged by an ulp) makes
    rows_exact say no for that shape, so the rows run one by one."""
    real = reference.rows_linear

    def nudged(x, weight, *, out=None):
        y = real(x, weight, out=out)
        if x.shape[0] > 1:
            y[-1].copy_(torch.nextafter(y[-1], torch.full_like(y[-1], float("inf"))))
        return y

    reference._rows_agree.cache_clear()
    monkeypatch.setattr(reference, "rows_linear", nudged)
    try:
        assert not rows_exact(torch.float32, 96, 80)
    finally:
        reference._rows_agree.cache_clear()
    monkeypatch.undo()
    assert rows_exact(torch.float32, 96, 80)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_float_codes_are_unpacks_codes(bits):
    torch.manual_seed(1)
    w = torch.randn(48, 256)
    q, scales, biases = affine.quantize(w, bits, 64)
    for words in (q, q.view(torch.int32)):
        assert torch.equal(affine.float_codes(words, bits), affine.unpack(words, bits).to(torch.float32))
        codes = affine.unpack(words, bits).to(torch.float32).reshape(48, -1, 64)
        reference = (codes * scales.float()[..., None] + biases.float()[..., None]).reshape(48, -1)
        assert torch.equal(affine.dequantize(words, scales, biases, bits, 64), reference)


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_dequantize_many_gives_each_matrix_dequantizes_bits(bits):
    torch.manual_seed(2)
    parts = [affine.quantize(torch.randn(o, i), bits, 64) for o, i in ((128, 256), (128, 256), (256, 128))]
    parts = [(q.view(torch.int32), s.to(torch.bfloat16), b.to(torch.bfloat16)) for q, s, b in parts]
    together = affine.dequantize_many(parts, bits, 64)
    for (q, s, b), w in zip(parts, together):
        assert torch.equal(w, affine.dequantize(q, s, b, bits, 64))


def test_unpacked_experts_keep_a_copy_while_the_slot_holds_the_expert():
    made = []

    def unpack(tag):
        def make():
            made.append(tag)
            return (torch.full((2, 2), float(len(made))),)
        return make

    cache = UnpackedExperts(2, entry_bytes=16)
    first = cache.get(0, 5, slot=3, unpack=unpack("a"))
    assert cache.get(0, 5, slot=3, unpack=unpack("b")) is first  # kept
    other_layer = cache.get(1, 5, slot=3, unpack=unpack("c"))  # slot 3 now holds layer 1's expert 5
    assert other_layer is not first and made == ["a", "c"]
    cache.get(0, 6, slot=4, unpack=unpack("d"))
    cache.get(0, 7, slot=5, unpack=unpack("e"))  # a third slot: the least recently used (slot 3) goes
    cache.get(1, 5, slot=3, unpack=unpack("f"))
    assert made == ["a", "c", "d", "e", "f"]
    stats = cache.stats()
    assert stats["unpacked_experts"] == 2 and stats["unpacked_bytes"] == 32
    assert stats["unpacked_hits"] == 1 and stats["unpacked_misses"] == 5
    none = UnpackedExperts(0)
    none.get(0, 1, slot=0, unpack=unpack("g"))
    none.get(0, 1, slot=0, unpack=unpack("h"))
    assert made[-2:] == ["g", "h"] and none.stats()["unpacked_experts"] == 0


def test_unpacked_limit_is_a_quarter_of_the_budget():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    size = 1 << 20
    assert unpacked_limit(EngineOptions(), cuda, unpacked_bytes=size, total_experts=100) == 0
    budget = EngineOptions(memory_budget="40MiB")
    assert unpacked_limit(budget, cpu, unpacked_bytes=size, total_experts=100) == 10  # a quarter of the budget
    assert unpacked_limit(EngineOptions(memory_budget="1GiB"), cpu, unpacked_bytes=size, total_experts=100) == 100
