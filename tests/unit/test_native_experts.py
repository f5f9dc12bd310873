"""The native CPU expert kernels (moestream.cpu_share.kernels) against the torch reference,
straight from records in the packed layout: 4 and 8 bits, odd shapes, every group size and scale
dtype they take, several tokens and experts per call, the routing weights; the layouts they refuse,
malformed calls as errors (never a crash), and no extension where it is switched off."""
import dataclasses

import pytest
import torch

from moestream.cpu_share import kernels as native
from moestream.kernels.reference import expert_ffn
from moestream.quant.affine import QuantSpec, quantize

PROJS = ("gate_proj", "up_proj", "down_proj")


def make_record(hidden, inter, bits, group, scale_dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rec = {}
    for proj, (rows, cols) in {"gate_proj": (inter, hidden), "up_proj": (inter, hidden),
                               "down_proj": (hidden, inter)}.items():
        w, s, b = quantize(torch.randn(rows, cols, generator=g).to(scale_dtype), bits, group)
        rec.update({f"{proj}.weight": w.view(torch.int32), f"{proj}.scales": s, f"{proj}.biases": b})
    return rec, {p: QuantSpec(bits, group) for p in PROJS}


@pytest.fixture(scope="module")
def module():
    built = native.load()
    assert built is not None, native.reason()
    return built


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("hidden,inter,group", [(192, 96, 32), (384, 128, 128), (320, 64, 64), (512, 256, 256)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_the_native_kernels_match_the_reference(module, bits, hidden, inter, group, scale_dtype):
    recs = [make_record(hidden, inter, bits, group, scale_dtype, seed=s) for s in range(3)]
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    fields, quant = native.record_blob(recs[0][0])[1], recs[0][1]
    assert native.refusal(fields, quant) is None
    layout = native.layout(fields, quant, int8_activations=False)  # float32 throughout (int8: test_native_int8)
    x = torch.randn(3, hidden, generator=torch.Generator().manual_seed(7))
    # pairs: (expert, token, weight), an expert used by two tokens, a token by two experts
    experts, tokens, weights = [2, 0, 2, 1, 0], [0, 0, 1, 2, 2], [0.5, -1.25, 2.0, 0.75, 1.0]
    out = torch.full((len(experts), hidden), float("nan"))
    native.weighted_rows(module, layout, blobs, experts, tokens, weights, x, out, threads=2)
    for p, (e, t, w) in enumerate(zip(experts, tokens, weights)):
        ref = expert_ffn(x[t:t + 1], recs[e][0], recs[e][1])[0] * w
        assert torch.allclose(out[p], ref, rtol=1e-4, atol=1e-4 * ref.abs().max().item()), (p, (out[p] - ref).abs().max())


@pytest.mark.parametrize("int8", [False, True])
def test_a_row_does_not_depend_on_the_thread_count_or_the_other_pairs(module, int8):
    rec, quant = make_record(256, 128, 4, 64, seed=4)
    blob, fields = native.record_blob(rec)
    layout = native.layout(fields, quant, int8_activations=int8)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(3))
    alone, together = torch.empty(1, 256), torch.empty(2, 256)
    native.weighted_rows(module, layout, [blob], [0], [1], [0.3], x, alone, threads=1)
    native.weighted_rows(module, layout, [blob], [0, 0], [0, 1], [1.0, 0.3], x, together, threads=2)
    assert torch.equal(alone[0], together[1])


def test_the_same_bits_on_any_team(module):
    """Each row is one member's from start to end, whichever member takes it: so the team's size,
    and a team kept between calls, change no bit."""
    recs = [make_record(256, 128, 4, 64, seed=s) for s in range(4)]
    blobs = [native.record_blob(r)[0] for r, _ in recs]
    layout = native.layout(native.record_blob(recs[0][0])[1], recs[0][1])
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(5))
    experts, tokens, weights = [3, 1, 0, 2, 1], [0, 0, 1, 1, 1], [0.5, 1.0, -0.25, 2.0, 0.75]
    first = None
    for threads in [1, 3, 3, 2, 1]:
        out = torch.full((len(experts), 256), float("nan"))
        native.weighted_rows(module, layout, blobs, experts, tokens, weights, x, out, threads=threads)
        assert not out.isnan().any(), threads
        first = out if first is None else first
        assert torch.equal(out, first), threads


def test_layouts_the_native_kernels_refuse():
    rec, quant = make_record(128, 64, 4, 64)
    fields = native.record_blob(rec)[1]
    assert native.refusal(fields, quant) is None
    gelu = {p: dataclasses.replace(q, activation="gelu_tanh") for p, q in quant.items()}
    assert "SwiGLU" in native.refusal(fields, gelu)
    mx = {p: dataclasses.replace(q, mode="mxfp4") for p, q in quant.items()}  # affine fields: not MXFP4's layout
    assert "MXFP4 needs bits 4 and group size 32" in native.refusal(fields, mx)
    other = {**quant, "down_proj": dataclasses.replace(quant["down_proj"], mode="nvfp4")}
    assert "quant modes ['affine', 'nvfp4']" in native.refusal(fields, other)
    assert "not quantized" in native.refusal(fields, {**quant, "down_proj": QuantSpec(None)})
    assert "group sizes" in native.refusal(fields, {**quant, "down_proj": QuantSpec(4, 32)})
    assert "no down_proj.biases" in native.refusal([f for f in fields if f.name != "down_proj.biases"], quant)
    three = {p: QuantSpec(3, 64) for p in PROJS}
    assert "4 or 8 bits" in native.refusal(fields, three)


def test_malformed_calls_are_errors(module):
    rec, quant = make_record(128, 64, 4, 64)
    blob, fields = native.record_blob(rec)
    layout = native.layout(fields, quant)
    x, out = torch.randn(1, 128), torch.empty(2, 128)
    with pytest.raises(RuntimeError, match="out of range"):
        native.weighted_rows(module, layout, [blob], [1], [0], [1.0], x, out, threads=1)
    with pytest.raises(RuntimeError, match="out of range"):
        native.weighted_rows(module, layout, [blob], [0], [1], [1.0], x, out, threads=1)
    with pytest.raises(RuntimeError, match="null"):
        module.weighted_rows(layout, torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int32),
                             torch.zeros(1, dtype=torch.int32), torch.ones(1), x, out, 1)
    bad = layout.clone()
    bad[4] = 48  # a group size they do not take
    with pytest.raises(RuntimeError, match="group size"):
        native.weighted_rows(module, bad, [blob], [0], [0], [1.0], x, out, threads=1)


def test_a_failed_build_is_one_line_not_a_traceback(monkeypatch):
    import torch.utils.cpp_extension as cpp

    def broken(*args, **kwargs):
        raise RuntimeError("Error building extension 'x': [1/2] c++ ...\nfoo.cpp:1:1: error: no compiler here\nninja: build stopped")

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(cpp, "load", broken)
    assert native.load() is None and native.load() is None  # tried once
    assert native.reason() == "foo.cpp:1:1: error: no compiler here"
