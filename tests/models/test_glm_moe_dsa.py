"""GLM-5 (`glm_moe_dsa`) against transformers on tiny random configs (fp32, decisive
routing): multi-head latent attention made sparse by DeepSeek's lightning indexer.

The indexer keeps fewer tokens than the prompts hold (index_topk 5 of 12 and more), so the
choice shows in every check; layers with their own indexer and layers sharing the last
one's choice; leading dense layers; YaRN with DeepSeek's softmax correction and plain rope;
grouped routing with routed scaling; transformers 5's config and fused experts, and the
Hub's per-expert layout with first_k_dense_replace and an indexer pattern.
"""

from __future__ import annotations

import json

import pytest

from freetoken.models.glm_moe_dsa import ModelArgs, indexer_types
from tests.models import family, mla

DSA = dict(
    mla.BASE,
    num_hidden_layers=4,
    q_lora_rank=24,
    index_topk=5,
    index_head_dim=24,
    index_n_heads=8,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)
SHARED = dict(
    DSA,
    rope_parameters=mla.yarn(1.0, 0.8),
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    indexer_types=["full", "shared", "full", "shared"],
    n_group=4,
    topk_group=2,
)
PLAIN = dict(
    DSA,
    rope_parameters=mla.DEFAULT_ROPE,
    mlp_layer_types=["dense", "dense", "sparse", "sparse"],
    indexer_types=["full"] * 4,
    attention_bias=True,
    norm_topk_prob=False,
)


def _build(tmp_path_factory, name, config, seed, **kw):
    from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    path = tmp_path_factory.mktemp(name)
    return path, mla.build(path, GlmMoeDsaConfig, GlmMoeDsaForCausalLM, config, seed, **kw)


@pytest.fixture(scope="module")
def shared(tmp_path_factory):
    return _build(tmp_path_factory, "dsa-shared", SHARED, seed=21, original_format=False)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "dsa-plain", PLAIN, seed=22)
    mla.hub_spelling(path)
    c = json.loads((path / "config.json").read_text())
    c["index_topk_pattern"] = "F" * len(c.pop("indexer_types"))
    (path / "config.json").write_text(json.dumps(c))
    return path, hf


@pytest.mark.parametrize("fixture", ["shared", "plain"])
def test_logits_match_transformers(fixture, request):
    family.logits_match(*request.getfixturevalue(fixture), prompt=family.LONG[:30])


@pytest.mark.parametrize("fixture", ["shared", "plain"])
def test_cached_decode_equals_uncached_forward(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    family.cached_decode_matches(path)


@pytest.mark.parametrize("fixture", ["shared", "plain"])
def test_greedy_continuation_matches_transformers(fixture, request):
    family.greedy_matches(*request.getfixturevalue(fixture))


def test_batched_sequences_match_single(shared):
    family.batched_matches_single(*shared)


def test_every_policy_streaming_and_resize_equal_resident(shared):
    path, hf = shared
    family.policies_match_resident(path, hf.config.n_routed_experts, moe_layers=3)


@pytest.mark.parametrize("fixture", ["shared", "plain"])
def test_fixed_shape_decode_gives_the_same_tokens(fixture, request):
    mla.fixed_shape_decode_matches(*request.getfixturevalue(fixture))


def test_prefix_cache_reuse_matches_transformers(shared):
    family.prefix_reuse_matches(*shared)


def test_bf16_keeps_what_transformers_keeps_in_fp32(shared):
    from transformers import GlmMoeDsaForCausalLM

    family.bf16_dtypes_match(shared[0], GlmMoeDsaForCausalLM)


def test_show_describes_the_model(shared, tmp_path):
    info = mla.show_describes(*shared, tmp_path, "glm-dsa")
    assert info["glm-dsa.leading_dense_block_count"] == 1
    assert info["glm-dsa.attention.indexer.top_k"] == 5


def test_model_file_reads_both_spellings(shared, plain):
    a = ModelArgs.from_dict(json.loads((shared[0] / "config.json").read_text()))
    assert a.indexer_types == ("full", "shared", "full", "shared") and a.dense_layers == (0,)
    assert a.rope_scaling.kind == "yarn" and a.index_topk == 5 and a.n_group == 4
    b = ModelArgs.from_dict(json.loads((plain[0] / "config.json").read_text()))
    assert b.indexer_types == ("full",) * 4 and b.dense_layers == (0, 1)
    assert indexer_types({"index_topk_freq": 2, "index_skip_topk_offset": 2}, 6) == (
        "full",
        "full",
        "shared",
        "full",
        "shared",
        "full",
    )


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", [("resident", 0), ("lru-pcie", 13)])
def test_captured_decode_on_a_gpu_matches_transformers(shared, policy, slots):
    mla.captured_decode_matches(*shared, policy, slots)


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs_matches_transformers(shared):
    """fp32 on a GPU: prefill and decode through the sparse kernel, decode steps captured,
    alone and batched with a prefill longer than a decode step."""
    family.gpu_matches(*shared)
