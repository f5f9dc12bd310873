"""Router functions against transformers' routers on random inputs."""
import pytest
import torch
import torch.nn.functional as F

from moestream.layers.routers import sigmoid_topk


def glm_router(E, H, **overrides):
    from transformers import Glm4MoeConfig
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter

    cfg = Glm4MoeConfig(hidden_size=H, n_routed_experts=E, **overrides)
    router = Glm4MoeTopkRouter(cfg)
    with torch.no_grad():
        router.weight.normal_(0, 0.5)
        router.e_score_correction_bias.normal_(0, 0.3)
    return router


@pytest.mark.parametrize("groups", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_topk_matches_the_glm4_moe_router(groups, normalize):
    torch.manual_seed(0)
    n_group, topk_group = groups
    E, H, A = 16, 32, 4
    ref = glm_router(E, H, num_experts_per_tok=A, n_group=n_group, topk_group=topk_group, norm_topk_prob=normalize,
                     routed_scaling_factor=2.5)
    x = torch.randn(64, H)
    with torch.no_grad():
        _, ref_w, ref_ids = ref(x)
    weights, ids = sigmoid_topk(F.linear(x, ref.weight), A, correction_bias=ref.e_score_correction_bias,
                                n_group=n_group, topk_group=topk_group, normalize=normalize, scaling=2.5,
                                out_dtype=torch.float32)
    # the reference leaves the top k unsorted: compare each token's (id -> weight) map
    order, ref_order = ids.argsort(dim=-1), ref_ids.argsort(dim=-1)
    assert torch.equal(ids.gather(1, order), ref_ids.gather(1, ref_order))
    assert torch.allclose(weights.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)


def test_the_correction_bias_steers_the_choice_but_not_the_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    plain_w, plain_ids = sigmoid_topk(logits, 1, correction_bias=None, normalize=False, out_dtype=torch.float32)
    bias = torch.tensor([0.0, 0.0, 0.0, 5.0])
    w, ids = sigmoid_topk(logits, 1, correction_bias=bias, normalize=False, out_dtype=torch.float32)
    assert plain_ids.item() == 0 and ids.item() == 3
    assert w.item() == pytest.approx(torch.sigmoid(torch.tensor(-1.0)).item())  # the uncorrected score
    assert plain_w.item() == pytest.approx(torch.sigmoid(torch.tensor(2.0)).item())


def test_group_limit_excludes_experts_outside_the_best_groups():
    # group 0 = experts 0,1 (one strong), group 1 = experts 2,3 (two fairly strong: the better sum)
    logits = torch.tensor([[3.0, -6.0, 1.5, 1.5]])
    _, ids = sigmoid_topk(logits, 1, correction_bias=None, n_group=2, topk_group=1, normalize=False,
                          out_dtype=torch.float32)
    assert ids.item() in (2, 3)
    _, ids = sigmoid_topk(logits, 1, correction_bias=None, n_group=1, topk_group=1, normalize=False,
                          out_dtype=torch.float32)
    assert ids.item() == 0


def test_sigmoid_scores_of_a_row_are_its_own_beside_other_rows():
    """torch's CPU sigmoid rounds a tensor's tail with its scalar function: 8 experts a row put some
    of a 7-row step's scores there and none of a one-row step's; the router pads its rows."""
    from moestream.layers.routers import sigmoid_topk

    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(7, 8, generator=g)
        weights, ids = sigmoid_topk(logits, 2, correction_bias=None, normalize=True, out_dtype=torch.float32)
        for t in range(7):
            w, i = sigmoid_topk(logits[t:t + 1], 2, correction_bias=None, normalize=True, out_dtype=torch.float32)
            assert torch.equal(w[0], weights[t]) and torch.equal(i[0], ids[t])
