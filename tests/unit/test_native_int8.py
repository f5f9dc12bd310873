"""The native kernels' int8 activations (moestream/cpu_share/native/int8_rows.h) against the float
path and the torch reference: 4 and 8 bits, every group size, bf16/f16/f32 scales, several tokens
and pairs, Gaussian inputs and inputs with outlier channels; compiled in exactly where the CPU has
AVX-512 VNNI, chosen by the layout (int8 by default where compiled in).

Tolerance. Each token's x and each pair's h are rounded to int8 per 32 inputs (xs = max|x| / 127,
as llama.cpp's q8_0): an error of at most xs / 2 per input, about 0.6% of the inputs' rms where
they are Gaussian, carried through gate/up, SiLU and down. Measured over these shapes and seeds the
rows' relative L2 error is 1.1% typical, 1.8% at worst (computing in bf16 instead: 0.5%, 1.2%),
so the bound is 3% (torch's bf16 rtol is 1.6%); with a few inputs 20x the rest, which coarsen their
32's steps, 3.8% at worst, bound 6%. A wrong scale, lane, nibble or bias order gives errors of order
1, and the float path is 1e-6 from the reference: the int8 rows must land between."""
from pathlib import Path

import pytest
import torch

from moestream.cpu_share import kernels as native
from moestream.kernels.reference import expert_ffn
from tests.unit.test_native_experts import make_record

GAUSSIAN_BOUND, OUTLIER_BOUND = 3e-2, 6e-2


@pytest.fixture(scope="module")
def module():
    built = native.load()
    assert built is not None, native.reason()
    return built


def cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def rows(module, layout, blobs, x, experts, tokens, weights):
    out = torch.full((len(experts), x.shape[1]), float("nan"))
    native.weighted_rows(module, layout, blobs, experts, tokens, weights, x, out, threads=2)
    return out


def test_vnni_is_compiled_in_where_the_cpu_has_it(module):
    assert native.LAYOUT_LEN == module.LAYOUT_LEN
    has_vnni = {"avx512_vnni", "avx512bw", "avx512vl"} <= cpu_flags()
    assert module.VNNI == native.vnni() == has_vnni


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hidden,inter,group", [(192, 96, 32), (320, 64, 64), (384, 128, 128), (512, 256, 256)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("outliers", [False, True])
def test_int8_activations_stay_near_the_float_path_and_the_reference(module, bits, hidden, inter, group,
                                                                     scale_dtype, outliers):
    recs = [make_record(hidden, inter, bits, group, scale_dtype, seed=s) for s in range(3)]
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    fields, quant = native.record_blob(recs[0][0])[1], recs[0][1]
    g = torch.Generator().manual_seed(hidden + bits)
    x = torch.randn(3, hidden, generator=g)
    if outliers:  # a few channels 20x the rest, as hidden states have
        x[:, torch.randperm(hidden, generator=g)[:max(2, hidden // 64)]] *= 20
    experts, tokens, weights = [2, 0, 2, 1, 0], [0, 0, 1, 2, 2], [0.5, -1.25, 2.0, 0.75, 1.0]
    floats = rows(module, native.layout(fields, quant, int8_activations=False), blobs, x, experts, tokens, weights)
    int8 = rows(module, native.layout(fields, quant, int8_activations=True), blobs, x, experts, tokens, weights)
    if not module.VNNI:  # no int8 rows: the float ones ran
        assert torch.equal(int8, floats)
        return
    bound = OUTLIER_BOUND if outliers else GAUSSIAN_BOUND
    for p, (e, t, w) in enumerate(zip(experts, tokens, weights)):
        ref = expert_ffn(x[t:t + 1], recs[e][0], recs[e][1])[0] * w
        to_ref = ((int8[p] - ref).norm() / ref.norm()).item()
        to_float = ((int8[p] - floats[p]).norm() / floats[p].norm()).item()
        assert ((floats[p] - ref).norm() / ref.norm()).item() < 1e-5, p
        assert 1e-4 < to_float < bound and to_ref < bound, (p, to_float, to_ref)


def test_int8_activations_where_the_cpu_has_vnni_else_float_rows(module):
    rec, quant = make_record(128, 64, 4, 64)
    blob, fields = native.record_blob(rec)
    x = torch.randn(1, 128, generator=torch.Generator().manual_seed(5))
    floats = rows(module, native.layout(fields, quant, int8_activations=False), [blob], x, [0], [0], [1.0])
    int8 = rows(module, native.layout(fields, quant, int8_activations=True), [blob], x, [0], [0], [1.0])
    assert native.activations() == ("int8" if module.VNNI else "float")
    layout = native.layout(fields, quant)  # the default
    assert int(layout[native.INT8_ACTS]) == int(module.VNNI)
    assert torch.equal(rows(module, layout, [blob], x, [0], [0], [1.0]), int8 if module.VNNI else floats)
    assert int(layout[-1]) == int(native.layout(fields, quant, int8_activations=False)[-1]) > 0  # bytes last
