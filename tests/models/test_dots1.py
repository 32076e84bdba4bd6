"""dots.llm1 against transformers on tiny random configs (fp32): per-head q/k norms with full
rotary, attention biases, a sliding-window layer, a first dense layer, shared experts,
grouped sigmoid routing with a correction bias, renormalised and scaled; llama.cpp's dots1
GGUF."""

from __future__ import annotations

import json

import pytest

from freetoken.models import dots1
from tests import fixtures
from tests.models import family

CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,  # not hidden / heads
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    n_group=2,
    topk_group=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    attention_bias=True,
    sliding_window=5,
    max_window_layers=2,  # the last layer slides
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)


def _build(tmp_path_factory, name, seed, original_format=True, **overrides):
    from transformers import Dots1Config, Dots1ForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        Dots1Config,
        Dots1ForCausalLM,
        {**CONFIG, **overrides},
        seed=seed,
        original_format=original_format,
        rerandomize_params=family.rerandomize_with_biases,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _build(tmp_path_factory, "dots1", seed=71)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return _build(tmp_path_factory, "dots1-fused", seed=72, original_format=False)


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_logits_and_greedy_tokens_match_transformers(layout, request):
    path, hf = request.getfixturevalue(layout)
    family.logits_match(path, hf)
    family.greedy_matches(path, hf)


def test_cached_decode_equals_uncached_forward(hub):
    family.cached_decode_matches(hub[0])


def test_batched_sequences_match_single(hub):
    family.batched_matches_single(*hub)


def test_every_policy_matches_resident(hub):
    family.policies_match_resident(hub[0], num_experts=8, moe_layers=2)


def test_structure_follows_the_config(hub):
    path, _ = hub
    config = json.loads((path / "config.json").read_text())
    model = dots1.Model.from_config(config)
    assert model.moe_layers == [1, 2]
    assert [layout.window for layout in model.kv_layout()] == [0, 0, 5]
    assert dots1.ModelArgs.from_dict(family.hub_spelling(config)) == model.args
    # a Hub config that spells no layer types: sliding from max_window_layers on
    no_types = {k: v for k, v in family.hub_spelling(config).items() if k != "layer_types"}
    assert dots1.ModelArgs.from_dict(no_types).layer_types == model.args.layer_types
    info = dots1.Model.model_info(config)
    assert info["dots1.leading_dense_block_count"] == 1 and info["dots1.expert_count"] == 8
    assert info["dots1.expert_weights_scale"] == 2.5 and info["dots1.expert_shared_count"] == 1


def test_gguf_import_matches_transformers(tmp_path_factory):
    """llama.cpp's dots1 writes no window: a model without sliding layers."""
    path, hf = _build(tmp_path_factory, "dots1-full", seed=73, sliding_window=None)
    family.logits_match(path, hf)
    family.gguf_matches(path, hf, tmp_path_factory.mktemp("gguf"), "dots1")


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)
