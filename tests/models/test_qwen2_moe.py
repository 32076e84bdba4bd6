"""Qwen2-MoE against transformers on tiny random configs (fp32): q/k/v biases without an
output bias, a shared expert behind its sigmoid gate, top-k weights not renormalised, a
dense MLP layer, and a sliding-window layer whose window is shorter than the prompt."""

from __future__ import annotations

import json

import pytest

from freetoken.models import qwen2_moe
from tests import fixtures
from tests.models import family

CONFIG = dict(
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    mlp_only_layers=[1],
    use_sliding_window=True,
    sliding_window=5,
    max_window_layers=1,  # layer 0 slides, layers 1 and 2 see everything
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
)
# what llama.cpp's qwen2moe converter can write: no dense layers, no window
GGUF_CONFIG = {**CONFIG, "num_hidden_layers": 2, "mlp_only_layers": [], "use_sliding_window": False}


def _build(tmp_path_factory, name, config, seed, original_format=True):
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        Qwen2MoeConfig,
        Qwen2MoeForCausalLM,
        config,
        seed=seed,
        original_format=original_format,
        rerandomize_params=family.rerandomize_with_biases,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Per-expert tensors, as the Hub's checkpoints hold them."""
    return _build(tmp_path_factory, "qwen2-moe", CONFIG, seed=11)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """The fused expert banks transformers 5 saves with save_original_format=False."""
    return _build(tmp_path_factory, "qwen2-moe-fused", CONFIG, seed=12, original_format=False)


@pytest.mark.parametrize("layout", ["hub", "fused"])
def test_logits_and_greedy_tokens_match_transformers(layout, request):
    path, hf = request.getfixturevalue(layout)
    family.logits_match(path, hf)
    family.greedy_matches(path, hf)


def test_cached_decode_equals_uncached_forward(hub):
    family.cached_decode_matches(hub[0])


def test_batched_sequences_match_single(hub):
    family.batched_matches_single(*hub)


def test_fixed_shape_decode_matches_transformers(hub):
    family.fixed_shape_decode_matches(*hub)


def test_every_policy_matches_resident(hub):
    family.policies_match_resident(hub[0], num_experts=8, moe_layers=2)


def test_structure_follows_the_config(hub):
    path, _ = hub
    config = json.loads((path / "config.json").read_text())
    model = qwen2_moe.Model.from_config(config)
    assert model.moe_layers == [0, 2]
    assert [lay.window for lay in model.kv_layout()] == [5, 0, 0]
    # the Hub's spelling: top-level rope_theta, no layer_types or qkv_bias
    hub_config = family.hub_spelling(config)
    for key in ("layer_types", "qkv_bias"):
        hub_config.pop(key)
    assert qwen2_moe.ModelArgs.from_dict(hub_config) == model.args
    info = qwen2_moe.Model.model_info(config)
    assert info["qwen2moe.expert_shared_feed_forward_length"] == 48
    assert info["qwen2moe.attention.sliding_window"] == 5


def test_gguf_import_matches_transformers(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "qwen2-moe-gguf", GGUF_CONFIG, seed=13)
    family.gguf_matches(path, hf, tmp_path_factory.mktemp("gguf"), "qwen2moe")


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)
