"""Resident matrices kept packed on the CPU (moestream.layers.packed_matrix) against the dequantized
matrix: products within float32 rounding of the dequantized matrix times the inputs as the products
take them (int8-rounded per 32 where the CPU has VNNI: `int8_rounded`; as they are on the float
path, run here too), a row's bits the same alone, beside other rows, through rows_linear's batched
call, in a prefill chunk's tiles and on any team; row slices, concatenation
(fuse_qkv), row gathers and any other function exactly the dequantized matrix's; the loader packs
the attention and head matrices of a quantized model on the CPU, and nothing without the build."""
import pytest
import torch
import torch.nn.functional as F

from moestream.cpu_share import kernels as native
from moestream.engine.engine import Engine
from moestream.engine.options import EngineOptions
from moestream.kernels.reference import int8_rounded, rows_linear
from moestream.layers.attention import AttentionWeights
from moestream.layers.packed_matrix import PackedMatrix, packed_matrix
from moestream.quant.affine import QuantSpec, dequantize, quantize

# float32 rounding of sums over K products, relative to the output's largest entry (activations
# rounded other than the reference says, or a code read from the wrong nibble, land orders of
# magnitude above)
TOLERANCE = 2e-6


@pytest.fixture(params=["default", "float"])
def activations(request, monkeypatch):
    """Each test on the path this CPU takes and on the float rows (the path without VNNI)."""
    if request.param == "float":
        monkeypatch.setattr(native, "activations", lambda: "float")
    return native.activations()


def as_taken(x: torch.Tensor, activations: str) -> torch.Tensor:
    return int8_rounded(x) if activations == "int8" else x


def matrix(out_f: int, in_f: int, bits: int = 4, group: int = 64, scale_dtype=torch.bfloat16, seed: int = 0):
    w = torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(seed))
    q, s, b = quantize(w.to(scale_dtype), bits, group)
    return packed_matrix(q, s, b, QuantSpec(bits, group)), dequantize(q.view(torch.int32), s, b, bits, group)


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_products_match_the_dequantized_matrix(bits, group, scale_dtype, activations):
    m, w = matrix(136, 384, bits, group, scale_dtype)
    x = torch.randn(5, 384, generator=torch.Generator().manual_seed(1))
    expected = F.linear(as_taken(x, activations), w)
    error = (F.linear(x, m) - expected).abs().max().item() / expected.abs().max().item()
    assert error < TOLERANCE, error


def test_int8_activations_where_the_cpu_has_vnni():
    assert native.activations() == ("int8" if native.vnni() else "float")
    m, w = matrix(64, 256)
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(6))
    error = (F.linear(x, m) - F.linear(x, w)).abs().max().item() / F.linear(x, w).abs().max().item()
    assert (1e-4 < error < 3e-2) if native.vnni() else error < TOLERANCE, error  # int8: ~0.5 % of the norm


def test_a_rows_bits_alone_beside_others_batched_and_on_any_team(activations):
    m, _ = matrix(200, 256)
    x = torch.randn(7, 256, generator=torch.Generator().manual_seed(2))
    together = F.linear(x, m)
    for t in range(7):
        assert torch.equal(F.linear(x[t:t + 1], m)[0], together[t])
    assert torch.equal(rows_linear(x, m).view(7, -1), together)  # bmm over .t().expand()
    assert torch.equal(rows_linear(x[:1], m).view(1, -1), together[:1])  # mm over .t()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(F.linear(x, m), together)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("bits", [4, 8])
def test_a_prefill_chunks_rows_are_each_rows_alone(bits, activations):
    """More rows than a step (tiles of tokens over several token blocks, and a remainder): each
    output row has the bits it has alone, whatever the rows around it and the team."""
    m, w = matrix(37, 256, bits=bits)  # an odd row count: a last row computed on its own
    x = torch.randn(41, 256, generator=torch.Generator().manual_seed(3))
    chunk = F.linear(x, m)
    expected = F.linear(as_taken(x, activations), w)
    assert (chunk - expected).abs().max().item() / expected.abs().max().item() < TOLERANCE
    for t in (0, 3, 4, 15, 16, 33, 40):
        assert torch.equal(F.linear(x[t:t + 1], m)[0], chunk[t]), t
    assert torch.equal(F.linear(x[5:30], m), chunk[5:30])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.equal(F.linear(x, m), chunk)
    finally:
        torch.set_num_threads(before)


def test_other_functions_get_the_dequantized_matrixs_bits():
    m, w = matrix(96, 256, bits=8)
    assert torch.equal(m * 2, w * 2) and torch.equal(m.sum(0), w.sum(0))
    rows = m.index_select(0, torch.tensor([5, 1, 90])).contiguous()  # the hot head's: packed rows
    assert isinstance(rows, PackedMatrix) and torch.equal(rows.dequantized(), w[[5, 1, 90]])
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(7))
    assert torch.equal(F.linear(x, rows), F.linear(x, m)[:, [5, 1, 90]])
    assert m.shape == w.shape and m.dtype == w.dtype and m.numel() == w.numel() and m.dim() == 2


def test_fused_qkv_is_packed_rows_of_the_parts():
    (q, wq), (k, wk), (v, wv), (o, wo) = (matrix(n, 256, seed=s) for s, n in enumerate((128, 64, 64, 256)))
    fused = AttentionWeights(q=q, k=k, v=v, o=o)
    fused.fuse_qkv()
    assert isinstance(fused.qkv, PackedMatrix) and isinstance(fused.k, PackedMatrix)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(4))
    assert torch.equal(F.linear(x, fused.qkv), torch.cat([F.linear(x, p) for p in (q, k, v)], dim=-1))
    assert torch.equal(fused.v.dequantized(), wv) and torch.equal(fused.qkv.dequantized(), torch.cat([wq, wk, wv]))


def test_the_cpu_loader_packs_attention_and_head_matrices(tiny_packed_model, monkeypatch):
    packed = tiny_packed_model("qwen3_moe", "q4")
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    attn = engine.model.layers[0].attn.w
    assert all(isinstance(t, PackedMatrix) for t in (attn.qkv, attn.o, engine.model.lm_head))
    assert isinstance(engine.model.embed_weight, PackedMatrix)  # gathered by rows, dequantized as gathered
    engine.close()
    monkeypatch.setattr(native, "_state", {"reason": "no compiler here"})  # no build: float matrices
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    assert not isinstance(engine.model.lm_head, PackedMatrix) and not isinstance(engine.model.layers[0].attn.w.qkv,
                                                                                 PackedMatrix)
    engine.close()


def test_an_embeddings_rows_are_the_dequantized_matrixs(monkeypatch):
    m, w = matrix(50, 128, bits=4)
    ids = torch.tensor([[3, 49], [0, 3]])
    expected = F.embedding(ids, w)

    def whole(self):
        raise AssertionError("a lookup dequantized the whole matrix")

    monkeypatch.setattr(PackedMatrix, "dequantized", whole)  # only the rows looked up are dequantized
    assert torch.equal(F.embedding(ids, m), expected)


def test_an_embedding_gathers_its_rows_without_dequantizing_the_matrix(monkeypatch):
    m, w = matrix(50, 128, bits=4)
    monkeypatch.setattr(PackedMatrix, "dequantized", lambda self: pytest.fail("the whole matrix dequantized"))
    assert torch.equal(F.embedding(torch.tensor([7, 1]), m), F.embedding(torch.tensor([7, 1]), w))


def test_a_tied_embedding_is_the_packed_head(tiny_packed_model):
    packed = tiny_packed_model("gemma4_text", "q4")
    engine = Engine.load(packed, options=EngineOptions(device="cpu"))
    model = engine.model
    assert isinstance(model.lm_head, PackedMatrix) and model.embed_weight is model.lm_head
    engine.close()
