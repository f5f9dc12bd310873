"""The RMSNorm-rows and per-head norm + rotary kernels (moestream.kernels.triton_norm) under Triton's
CPU interpreter: each kind gives the torch function it stands for (float32 here: the interpreter
truncates where a GPU rounds, so bfloat16 bits are checked on the GPU), over strided inputs, with
partial rotary and a scale; rows past the rotary pass through.

Runs in CI's interpreter stage (TRITON_INTERPRET=1)."""
import pytest
import torch

pytest.importorskip("triton")

from interpreter import interpreted_module, relative_error  # noqa: E402
from moestream.layers.attention import offset_rms_norm  # noqa: E402
from moestream.layers.norm import rms_norm  # noqa: E402
from moestream.layers.norm_f32 import rms_norm_f32  # noqa: E402
from moestream.layers.rope import Rope, apply_rope  # noqa: E402


@pytest.fixture(scope="module")
def kn():
    return interpreted_module("moestream.kernels.triton_norm")


NORMS = {"round": rms_norm, "f32": rms_norm_f32, "plain": lambda x, w, eps: rms_norm_f32(x, None, eps)}


@pytest.mark.parametrize("kind", ["round", "f32", "plain"])
@pytest.mark.parametrize("shape", [(7, 48), (3, 5, 40), (2, 3, 4, 24)])
def test_rms_rows_give_the_torch_norm(kn, kind, shape):
    g = torch.Generator().manual_seed(len(shape))
    wide = torch.randn(*shape[:-1], shape[-1] + 8, generator=g)  # strided rows: a slice of wider ones
    x, w = wide[..., 3:3 + shape[-1]], torch.randn(shape[-1], generator=g)
    got = kn.rms_norm_rows(x, None if kind == "plain" else w, 1e-6, kind)
    want = NORMS[kind](x, w, 1e-6)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert relative_error(got, want) < 1e-6


def test_offset_norm_is_the_f32_kind(kn):
    x, scale = torch.randn(4, 32), 1 + torch.randn(32) / 10
    assert relative_error(kn.rms_norm_rows(x, scale, 1e-6, "f32"), offset_rms_norm(x, scale, 1e-6)) < 1e-6


@pytest.mark.parametrize("kind", [None, "round", "f32", "plain"])
@pytest.mark.parametrize("rotary,scale", [(32, 1.0), (20, 1.3)])
def test_norm_rope_gives_the_norm_then_apply_rope(kn, kind, rotary, scale):
    g = torch.Generator().manual_seed(rotary)
    T, N, D = 6, 3, 32
    qkv = torch.randn(T, N * D + 16, generator=g)
    x = qkv[:, 16:].view(T, N, D)  # a view of the projection, as Attention._project gives it
    w = torch.randn(D, generator=g)
    rope = Rope(D, 1e4, torch.device("cpu"), rotary_dim=rotary, scale=scale)
    positions = torch.tensor([0, 1, 9, 500, 4095, 7])
    normed = x if kind is None else NORMS[kind](x, w, 1e-6)
    cos, sin = rope.cos_sin(positions, x.dtype)
    want = apply_rope(normed.transpose(0, 1), cos, sin).transpose(0, 1)
    got = kn.norm_rope(x, positions, rope.inv_freq, rope.scale, weight=None if kind == "plain" else w, eps=1e-6,
                       kind=kind)
    assert got.shape == (T, N, D) and got.is_contiguous()
    assert relative_error(got, want) < 1e-5
    assert torch.equal(got[..., rotary:], normed[..., rotary:].contiguous())


def test_round_kind_with_a_float32_weight_rounds_to_the_input_dtype_first(kn):
    # rms_norm's order: the normed row in x's dtype, then times a float32 weight (a float32 result)
    x, w = torch.randn(3, 64, dtype=torch.float64).to(torch.float16), torch.randn(64)
    got, want = kn.rms_norm_rows(x, w, 1e-6, "round"), rms_norm(x, w, 1e-6)
    assert got.dtype == want.dtype == torch.float32
    assert relative_error(got, want) < 1e-6


# -- Gemma 4's sandwich norms (moestream.kernels.triton_sandwich) ------------------------------------

def _sandwich_block(H: int, g):
    from moestream.layers.sandwich import GemmaRouter, ParallelMoEBlock

    names = ("pre_feedforward_layernorm", "post_feedforward_layernorm", "post_feedforward_layernorm_1",
             "pre_feedforward_layernorm_2", "post_feedforward_layernorm_2")
    router = GemmaRouter(proj=torch.randn(8, H, generator=g), scale=torch.randn(H, generator=g),
                         per_expert_scale=torch.rand(8, generator=g) + 0.5, top_k=2, eps=1e-6)
    return ParallelMoEBlock(0, router, None, mlp=None, norms={n: torch.randn(H, generator=g) for n in names},
                            scalar=torch.tensor([0.7]), eps=1e-6)


@pytest.mark.parametrize("H", [48, 100])
def test_sandwich_tail_gives_the_torch_norms(H):
    ks = interpreted_module("moestream.kernels.triton_sandwich")
    g = torch.Generator().manual_seed(H)
    block, post = _sandwich_block(H, g), torch.randn(H, generator=g)
    x, a = torch.randn(5, H, generator=g), torch.randn(5, H, generator=g) * 3
    h, experts_in = block.tail(x, a, post)  # the torch ops (CPU tensors)
    mlp_in, router_in = block.pending
    n = block.norms
    got = ks.sandwich_tail(x, a, post, n["pre_feedforward_layernorm"], n["pre_feedforward_layernorm_2"],
                           block.gemma_router.scale, 1e-6, H ** -0.5)
    for y, want in zip(got, (h, mlp_in, experts_in, router_in)):
        assert y.shape == want.shape and y.dtype == want.dtype
        assert relative_error(y, want) < 1e-6


@pytest.mark.parametrize("H", [48, 100])
def test_sandwich_combine_gives_the_torch_combine(H):
    ks = interpreted_module("moestream.kernels.triton_sandwich")
    g = torch.Generator().manual_seed(H + 1)
    block = _sandwich_block(H, g)
    routed, dense, residual = (torch.randn(5, H, generator=g) for _ in range(3))
    want = block.combine(routed, dense, residual)
    n = block.norms
    got = ks.sandwich_combine(routed, dense, residual, n["post_feedforward_layernorm_2"],
                              n["post_feedforward_layernorm_1"], n["post_feedforward_layernorm"], block.scalar, 1e-6)
    assert relative_error(got, want) < 1e-6
    # a row's result is its own: the first rows alone give the same bits
    assert torch.equal(ks.sandwich_combine(routed[:2], dense[:2], residual[:2], n["post_feedforward_layernorm_2"],
                                           n["post_feedforward_layernorm_1"], n["post_feedforward_layernorm"],
                                           block.scalar, 1e-6), got[:2])


def test_route_topk_with_expert_scales_gives_the_torch_routing():
    from moestream.layers.routers import softmax_topk

    tr = interpreted_module("moestream.kernels.triton_route")
    g = torch.Generator().manual_seed(3)
    logits, scale = torch.randn(6, 24, generator=g), torch.rand(24, generator=g) + 0.5
    w, ids = tr.route_topk(logits, 4, normalize=True, out_dtype=torch.float32, expert_scale=scale)
    w_ref, ids_ref = softmax_topk(logits, 4, normalize=True, out_dtype=torch.float32, expert_scale=scale)
    assert torch.equal(ids, ids_ref) and relative_error(w, w_ref) < 1e-6


@pytest.mark.parametrize("kind", [None, "f32", "plain"])
def test_norm_rope_of_queries_and_keys_in_one_launch_gives_each_alone(kn, kind):
    g = torch.Generator().manual_seed(11)
    T, D = 5, 32
    q, k = torch.randn(T, 4, D, generator=g), torch.randn(T, 2, D, generator=g)
    wq, wk = torch.randn(D, generator=g), torch.randn(D, generator=g)
    rope = Rope(D, 1e4, torch.device("cpu"), rotary_dim=24)
    positions = torch.tensor([3, 0, 77, 12, 5])
    weights = (None, None) if kind == "plain" else (wq, wk)
    got_q, got_k = kn.norm_rope(q, positions, rope.inv_freq, rope.scale, weight=weights[0], eps=1e-6, kind=kind,
                                other=k, other_weight=weights[1])
    assert torch.equal(got_q, kn.norm_rope(q, positions, rope.inv_freq, rope.scale, weight=weights[0], eps=1e-6,
                                           kind=kind))
    assert torch.equal(got_k, kn.norm_rope(k, positions, rope.inv_freq, rope.scale, weight=weights[1], eps=1e-6,
                                           kind=kind))


def test_gelu_glu_of_the_stacked_products_gives_the_torch_activation():
    import torch.nn.functional as F

    ks = interpreted_module("moestream.kernels.triton_sandwich")
    g = torch.Generator().manual_seed(5)
    y = torch.randn(3, 2 * 1500, generator=g) * 3  # I = 1500: two blocks of columns, the second partial
    want = F.gelu(y[:, :1500], approximate="tanh") * y[:, 1500:]
    assert relative_error(ks.gelu_glu(y), want) < 1e-5
