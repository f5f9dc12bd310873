"""Lookahead guess accuracy and its fitted correction (moestream.experts.guess_maps,
moestream.engine.fit_lookahead): the scoring against hand-computed cases, the fit against a known
map, the file round trip and its checks."""
import pytest
import torch

from moestream.engine.fit_lookahead import Capture, evaluate, fit_maps
from moestream.experts.guess_maps import GuessMap, GuessMaps, choose_and_fit, fit_map, overlap, top_k
from moestream.layers.moe import MoEBlock


def block(layer, router, top_k=2):
    return MoEBlock(layer, router, route_fn=None, experts=None, top_k=top_k)


def test_overlap_is_the_share_of_the_chosen_experts_the_guess_names():
    guess = torch.tensor([[1, 2, 3, 4], [0, 5, 6, 7], [9, 9, 9, 9]])
    actual = torch.tensor([[4, 3, 9, 8], [7, 6, 5, 0], [1, 2, 3, 9]])
    assert overlap(guess, actual).tolist() == [0.5, 1.0, 0.25]


def test_accuracy_per_layer_by_hand():
    # 3 MoE layers (0, 1, 2), H = E = 4, top-2; routers are the identity (logit e = x[e]), so a
    # guess of layer l+d from hn_l is the two largest entries of hn_l
    eye = torch.eye(4)
    blocks = [block(0, eye), block(1, eye), block(2, eye)]
    cap = Capture(starts=[0])
    cap.hn[0] = torch.tensor([[9., 8, 0, 0], [0, 0, 9, 8], [9, 0, 8, 0]])  # guesses {0,1}, {2,3}, {0,2}
    cap.hn[1] = torch.tensor([[0., 9, 8, 0], [0, 0, 0, 1], [0, 0, 0, 1]])  # (depth 2) guesses {1,2}, {3,x}, {3,x}
    cap.hn[2] = torch.zeros(3, 4)
    cap.ids[0] = torch.tensor([[0, 1], [0, 1], [0, 1]])
    cap.ids[1] = torch.tensor([[0, 1], [2, 0], [0, 3]])
    cap.ids[2] = torch.tensor([[2, 1], [3, 1], [0, 2]])
    d1 = evaluate(cap, blocks, depth=1)
    # the first row has no previous token and is left out: rows 1 and 2 count
    # layer 1: guesses {2,3} vs {2,0} -> 0.5; {0,2} vs {0,3} -> 0.5; previous token: {0,1} vs {2,0} -> 0.5,
    # {2,0} vs {0,3} -> 0.5
    assert d1[1] == {"source_layer": 0, "router": 0.5, "previous_token": 0.5}
    # layer 2 from layer 1: row 1 guess {3, 2} (ties go to the lower index after 3: 0,0,0 -> index 0)
    g = top_k(cap.hn[1], 2)
    expect = (overlap(g[1:2], cap.ids[2][1:2]) + overlap(g[2:3], cap.ids[2][2:3])) / 2
    assert d1[2]["router"] == pytest.approx(float(expect))
    # previous token at layer 2: {2,1} vs {3,1} -> 0.5; {3,1} vs {0,2} -> 0
    assert d1[2]["previous_token"] == 0.25
    d2 = evaluate(cap, blocks, depth=2)
    # layer 2 from layer 0: {2,3} vs {3,1} -> 0.5; {0,2} vs {0,2} -> 1
    assert list(d2) == [2] and d2[2]["router"] == 0.75


def synthetic(n=4000, h=16, e=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) + 0.5
    router = torch.randn(e, h, generator=g)
    u, v = torch.randn(e, 2, generator=g), torch.randn(2, h, generator=g)  # the true correction has rank 2
    c = torch.randn(e, generator=g)
    y = x @ (router + u @ v).T + c
    return x, y, router, u @ v, c


def test_fit_recovers_a_known_map():
    x, y, router, delta, c = synthetic()
    m = fit_map(x, y, router, alpha=1e-8)
    assert torch.allclose(m.u @ m.v, delta, atol=1e-3)
    assert torch.allclose(m.bias, c, atol=1e-3)
    low = fit_map(x, y, router, alpha=1e-8, rank=2)  # rank 2 keeps all of it
    assert low.u.shape == (8, 2) and low.v.shape == (2, 16)
    assert torch.allclose(low.u @ low.v, delta, atol=1e-3)
    one = fit_map(x, y, router, alpha=1e-8, rank=1)  # rank 1 cannot
    assert (one.u @ one.v - delta).abs().max() > 0.1
    strong = fit_map(x, y, router, alpha=1e6)  # a strong ridge pulls the map back to the plain router
    assert (strong.u @ strong.v).abs().max() < 0.05


def test_chosen_fit_guesses_better_than_the_plain_router():
    x, y, router, _, _ = synthetic()
    actual = top_k(y, 3)
    m = choose_and_fit(x[:3000], y[:3000], actual[:3000], router)
    held = slice(3000, None)
    plain = overlap(top_k(x[held] @ router.T, 3), actual[held]).mean()
    fitted = overlap(top_k(x[held] @ router.T + m.correction(x[held]), 3), actual[held]).mean()
    assert fitted > 0.98 and plain < 0.9
    assert m.alpha == min(a for a in (1e-3, 1e-2, 1e-1, 1.0, 10.0))  # noise-free data wants the weakest ridge


def test_fit_maps_per_layer_and_depth_on_a_capture():
    # layer 1's input is layer 0's scaled and shifted: the map from 0 to 1 is known exactly
    g = torch.Generator().manual_seed(1)
    hn0 = torch.randn(2000, 6, generator=g)
    hn1 = hn0 * torch.tensor([1., -1, 2, 0.5, 1, 3]) + 0.3
    hn2 = hn1.flip(1)
    routers = [torch.randn(5, 6, generator=g) for _ in range(3)]
    blocks = [block(i, routers[i]) for i in range(3)]
    cap = Capture(starts=[0])
    for i, hn in enumerate((hn0, hn1, hn2)):
        cap.hn[i], cap.ids[i] = hn, top_k(hn @ routers[i].T, 2)
    maps = fit_maps(cap, blocks, depths=(1, 2))
    assert sorted(maps.maps) == [(1, 1), (2, 1), (2, 2)]
    for depth in (1, 2):
        for layer, row in evaluate(cap, blocks, depth=depth, maps=maps).items():
            assert row["fitted"] > 0.99 and row["fitted"] > row["router"], (layer, depth, row)


def test_maps_file_round_trip_and_checks(tmp_path):
    g = torch.Generator().manual_seed(2)
    m = GuessMap(torch.randn(4, 3, generator=g), torch.randn(3, 8, generator=g), torch.randn(4, generator=g), 0.1)
    maps = GuessMaps({(1, 1): m}, {"rank": 0})
    path = tmp_path / "lookahead.safetensors"
    maps.save(path)
    back = GuessMaps.load(path)
    assert back.meta["rank"] == 0 and back.get(1, 1).alpha == 0.1 and back.get(1, 2) is None
    assert torch.equal(back.get(1, 1).u, m.u) and torch.equal(back.get(1, 1).bias, m.bias)
    blocks = [block(0, torch.randn(4, 8)), block(1, torch.randn(4, 8))]
    back.check(blocks, 8)
    x = torch.randn(1, 8)
    assert torch.allclose(back.logits(blocks[1], 1, x), blocks[1].router_logits(x) + m.correction(x))
    assert torch.equal(back.logits(blocks[1], 2, x), blocks[1].router_logits(x))  # no map: the plain router
    with pytest.raises(ValueError, match="the model wants"):
        back.check(blocks, 16)
    with pytest.raises(ValueError, match="no such MoE layer pair"):
        back.check(blocks[1:], 8)
    bad = tmp_path / "other.safetensors"
    bad.write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match="cannot read lookahead maps"):
        GuessMaps.load(bad)
