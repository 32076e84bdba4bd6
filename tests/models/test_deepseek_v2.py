"""DeepSeek-V2 against transformers on tiny random configs (fp32, decisive routing).

Two configs between them: softmax routing greedy and group-limited greedy (n_group > 1,
topk_group < n_group); routed scaling != 1; a plain q_proj (V2-Lite) and low-rank q; YaRN
with DeepSeek's softmax correction and plain rope; a leading dense layer and none; MLP
biases; the Hub's layout and spelling, and transformers 5's. transformers' V2 router
ignores `norm_topk_prob`, and so does ours (the greedy config sets it).
"""

from __future__ import annotations

import pytest

from tests.models import family, mla

GROUPED = dict(
    mla.BASE,
    q_lora_rank=None,
    topk_method="group_limited_greedy",
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.0,
    rope_parameters=mla.yarn(0.707, 0.707, factor=8.0),
    first_k_dense_replace=1,
    n_shared_experts=2,
)
GREEDY = dict(
    mla.BASE,
    q_lora_rank=24,
    topk_method="greedy",
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    rope_parameters=mla.DEFAULT_ROPE,
    first_k_dense_replace=0,
    mlp_bias=True,
)


def _build(tmp_path_factory, name, config, seed, **kw):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = tmp_path_factory.mktemp(name)
    return path, mla.build(path, DeepseekV2Config, DeepseekV2ForCausalLM, config, seed, **kw)


@pytest.fixture(scope="module")
def grouped(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "ds2-grouped", GROUPED, seed=21)
    mla.hub_spelling(path)
    return path, hf


@pytest.fixture(scope="module")
def greedy(tmp_path_factory):
    return _build(tmp_path_factory, "ds2-greedy", GREEDY, seed=22, original_format=False)


@pytest.mark.parametrize("fixture", ["grouped", "greedy"])
def test_logits_match_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    family.logits_match(path, hf)


@pytest.mark.parametrize("fixture", ["grouped", "greedy"])
def test_cached_decode_equals_uncached_forward(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    family.cached_decode_matches(path)


@pytest.mark.parametrize("fixture", ["grouped", "greedy"])
def test_greedy_continuation_matches_transformers(fixture, request):
    path, hf = request.getfixturevalue(fixture)
    family.greedy_matches(path, hf)


def test_batched_sequences_match_single(grouped):
    family.batched_matches_single(*grouped)


def test_every_policy_streaming_and_resize_equal_resident(grouped):
    path, hf = grouped
    family.policies_match_resident(path, hf.config.n_routed_experts, moe_layers=2)


def test_fixed_shape_decode_gives_the_same_tokens(greedy):
    mla.fixed_shape_decode_matches(*greedy)


def test_gguf_import_matches_transformers(grouped, tmp_path):
    """Softmax gating in the metadata: the file is DeepSeek-V2's."""
    path, hf = grouped
    mla.gguf_matches(hf, path, tmp_path, "deepseek_v2")


def test_show_describes_the_model(grouped, tmp_path):
    info = mla.show_describes(*grouped, tmp_path, "deepseek2")
    assert info["deepseek2.expert_gating_func"] == 1
    assert info["deepseek2.attention.q_lora_rank"] == 0


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", [("resident", 0), ("lru-pcie", 9)])
def test_captured_decode_on_a_gpu_matches_transformers(grouped, policy, slots):
    mla.captured_decode_matches(*grouped, policy, slots)
