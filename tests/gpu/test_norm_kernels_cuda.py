"""The RMSNorm-rows and norm + rotary kernels on CUDA in bfloat16: within a rounding of the torch
ops they stand for (at positions up to 32k, where a cosine needs its argument reduced well), and each
row's bits the same whatever rows share the launch."""
import pytest
import torch

from moestream.kernels.triton_norm import norm_rope, rms_norm_rows
from moestream.layers.rope import Rope

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def torch_norm(x, w, eps, kind):
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    if kind == "round":
        return w * y.to(x.dtype)
    return (y if kind == "plain" else y * w.float()).to(x.dtype)


def close(got, want):  # one bfloat16 rounding apart at most
    return bool(((got.float() - want.float()).abs() <= want.float().abs() * 2 ** -7 + 1e-6).all())


@pytest.mark.parametrize("kind", ["round", "f32", "plain"])
@pytest.mark.parametrize("N", [128, 2816, 4096])
def test_rms_rows_match_torch_and_rows_stand_alone(kind, N):
    g = torch.Generator(device=DEV).manual_seed(N)
    x = torch.randn(16, N, device=DEV, generator=g).to(torch.bfloat16) * 3
    w = torch.randn(N, device=DEV, generator=g).to(torch.bfloat16)
    got = rms_norm_rows(x, None if kind == "plain" else w, 1e-6, kind)
    assert close(got, torch_norm(x, w, 1e-6, kind))
    for t in (0, 5, 15):
        assert torch.equal(rms_norm_rows(x[t:t + 1], None if kind == "plain" else w, 1e-6, kind), got[t:t + 1])


@pytest.mark.parametrize("D,rotary", [(128, 128), (256, 64), (512, 512)])
def test_norm_rope_matches_torch_and_rows_stand_alone(D, rotary):
    g = torch.Generator(device=DEV).manual_seed(D)
    T, N = 16, 4
    x = torch.randn(T, N, D, device=DEV, generator=g).to(torch.bfloat16)
    w = torch.randn(D, device=DEV, generator=g).to(torch.bfloat16)
    rope = Rope(D, 1e6, DEV, rotary_dim=rotary)
    positions = torch.tensor([0, 1, 2, 100, 511, 4095, 8191, 16383, 20000, 25000, 30000, 32767, 5, 6, 7, 8], device=DEV)
    got = norm_rope(x, positions, rope.inv_freq, 1.0, weight=w, eps=1e-6, kind="round")
    normed = torch_norm(x, w, 1e-6, "round")
    cos, sin = rope.cos_sin(positions, torch.bfloat16)
    rot = normed[..., :rotary]
    half = rotary // 2
    turned = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    want = torch.cat((rot * cos[:, None] + turned * sin[:, None], normed[..., rotary:]), dim=-1)
    assert (got.float() - want.float()).abs().max() <= 2 ** -6 * want.float().abs().max()
    for t in (0, 11, 15):
        assert torch.equal(norm_rope(x[t:t + 1], positions[t:t + 1], rope.inv_freq, 1.0, weight=w, eps=1e-6,
                                     kind="round"), got[t:t + 1])
