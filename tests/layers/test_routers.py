"""The grouped routers against transformers' own: DeepSeek-V3's sigmoid grouped top-k with a
correction bias and routed scaling (SigmoidGroupedTopK; GLM-4.7-Flash routes the same way),
DeepSeek-V2's softmax greedy / group-limited greedy (SoftmaxGroupedTopK), and DeepSeek-V4's
scored top-k and routing by token id (ScoredTopK, HashRouter)."""

from __future__ import annotations

import pytest
import torch

from freetoken.layers.routers import (
    HashRouter,
    ScoredTopK,
    SigmoidGroupedTopK,
    SoftmaxGroupedTopK,
)

E, H, T = 16, 32, 40


def _inputs(seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn((E, H), generator=g) / H**0.5 * 3,
        torch.randn(E, generator=g) * 0.3,
        torch.randn((T, H), generator=g),
    )


def _same_routes(got, want):
    """Equal expert sets and weights per token (both pick in no particular order)."""
    (w, ids), (w0, ids0) = got, want
    o, o0 = ids.argsort(dim=-1), ids0.argsort(dim=-1)
    assert torch.equal(ids.gather(1, o), ids0.gather(1, o0))
    assert torch.allclose(w.gather(1, o), w0.gather(1, o0).to(w.dtype), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "n_group,topk_group,k,norm,scaling",
    [(4, 2, 4, True, 2.5), (4, 1, 3, False, 1.0), (1, 1, 2, True, 1.8), (8, 3, 6, False, 0.5)],
)
def test_sigmoid_grouped_topk_matches_deepseek_v3(n_group, topk_group, k, norm, scaling):
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    cfg = DeepseekV3Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling_factor=scaling,
    )
    ref = DeepseekV3TopkRouter(cfg)
    ours = SigmoidGroupedTopK(
        H,
        E,
        k,
        n_group=n_group,
        topk_group=topk_group,
        norm_topk_prob=norm,
        routed_scaling=scaling,
    )
    weight, bias, x = _inputs(n_group * 10 + k)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ref.e_score_correction_bias.copy_(bias)
        ours.weight.copy_(weight)
        ours.e_score_correction_bias.copy_(bias)
        _, w0, ids0 = ref(x)
        _same_routes(ours(x), (w0, ids0))


@pytest.mark.parametrize(
    "method,n_group,topk_group,k,scaling",
    [("greedy", None, None, 4, 1.0), ("group_limited_greedy", 4, 2, 3, 16.0)],
)
def test_softmax_grouped_topk_matches_deepseek_v2(method, n_group, topk_group, k, scaling):
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    cfg = DeepseekV2Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=k,
        topk_method=method,
        n_group=n_group,
        topk_group=topk_group,
        routed_scaling_factor=scaling,
    )
    ref = DeepseekV2TopkRouter(cfg)
    groups = n_group if method == "group_limited_greedy" else 1
    ours = SoftmaxGroupedTopK(
        H, E, k, n_group=groups, topk_group=topk_group or 1, routed_scaling=scaling
    )
    weight, _, x = _inputs(k)
    with torch.no_grad():
        ref.weight.copy_(weight)
        ours.weight.copy_(weight)
        _, w0, ids0 = ref(x)
        _same_routes(ours(x), (w0, ids0))


def _v4_config(scoring: str, k: int, scaling: float):
    from transformers import DeepseekV4Config

    return DeepseekV4Config(
        hidden_size=H,
        n_routed_experts=E,
        num_experts_per_tok=k,
        scoring_func=scoring,
        routed_scaling_factor=scaling,
        vocab_size=64,
        num_hidden_layers=1,
    )


@pytest.mark.parametrize(
    "scoring,k,scaling", [("sqrtsoftplus", 4, 1.5), ("sigmoid", 2, 1.0), ("sqrtsoftplus", 3, 2.5)]
)
def test_scored_topk_matches_deepseek_v4(scoring, k, scaling):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4TopKRouter

    ref = DeepseekV4TopKRouter(_v4_config(scoring, k, scaling))
    ours = ScoredTopK(H, E, k, scoring, scaling)
    weight, bias, x = _inputs(len(scoring) + k)
    with torch.no_grad():
        for r in (ref, ours):
            r.weight.copy_(weight)
            r.e_score_correction_bias.copy_(bias)
        _, w0, ids0 = ref(x)
        _same_routes(ours(x), (w0, ids0))


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
def test_hash_router_matches_deepseek_v4(scoring):
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    k = 3
    ref = DeepseekV4HashRouter(_v4_config(scoring, k, 1.5))
    ours = HashRouter(H, E, k, 64, scoring, 1.5)
    weight, _, x = _inputs(5)
    g = torch.Generator().manual_seed(6)
    table = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(64)])
    tokens = torch.randint(0, 64, (T,), generator=g)
    with torch.no_grad():
        for r in (ref, ours):
            r.weight.copy_(weight)
            r.tid2eid.copy_(table)
        _, w0, ids0 = ref(x, tokens)
        _same_routes(ours(x, tokens), (w0, ids0))


def test_unknown_scoring_is_refused():
    with pytest.raises(ValueError, match="sqrtsoftplus"):
        ScoredTopK(H, E, 2, "softmax", 1.0)
