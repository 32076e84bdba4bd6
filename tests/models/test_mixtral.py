"""Mixtral against transformers on tiny random configs (fp32): top-2 routing over the
softmaxed logits, the Hub's block_sparse_moe/w1-w3-w2 names and transformers 5's fused
banks, and a sliding window shorter than the prompt on every layer. Its GGUF form is
llama.cpp's llama architecture, q/k rows permuted for GGML's rope."""

from __future__ import annotations

import json

import pytest

from freetoken.models import mixtral
from tests import fixtures
from tests.models import family

CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=5,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
# llama.cpp's llama converter writes no window (Mixtral's own checkpoints have none)
GGUF_CONFIG = {**CONFIG, "sliding_window": None}


def _build(tmp_path_factory, name, config, seed, original_format=True):
    from transformers import MixtralConfig, MixtralForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        MixtralConfig,
        MixtralForCausalLM,
        config,
        seed=seed,
        original_format=original_format,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """block_sparse_moe.experts.{e}.w1/w2/w3, as the Hub's checkpoints hold them."""
    return _build(tmp_path_factory, "mixtral", CONFIG, seed=21)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """mlp.experts.gate_up_proj/down_proj, as transformers 5 saves them unconverted."""
    return _build(tmp_path_factory, "mixtral-fused", CONFIG, seed=22, original_format=False)


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
    model = mixtral.Model.from_config(config)
    assert [lay.window for lay in model.kv_layout()] == [5, 5]
    assert mixtral.ModelArgs.from_dict(family.hub_spelling(config)) == model.args
    assert mixtral.Model.dense_key("model.layers.1.block_sparse_moe.gate.weight") == (
        "model.layers.1.mlp.gate.weight"
    )
    info = mixtral.Model.model_info(config)
    assert info["general.architecture"] == "llama" and info["llama.expert_count"] == 8
    assert info["llama.attention.sliding_window"] == 5


def test_gguf_import_matches_transformers(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "mixtral-gguf", GGUF_CONFIG, seed=23)
    family.gguf_matches(path, hf, tmp_path_factory.mktemp("gguf"), "llama")


def test_gguf_metadata():
    kv = {
        "llama.embedding_length": 64,
        "llama.attention.head_count": 4,
        "llama.block_count": 2,
        "llama.feed_forward_length": 32,
        "llama.expert_count": 8,
        "llama.expert_used_count": 2,
        "llama.attention.sliding_window": 4096,
    }
    config = mixtral.Model.config_from_gguf(kv, "llama")
    assert config["sliding_window"] == 4096 and config["rope_pairs"]
    assert config["num_key_value_heads"] == 4 and config["head_dim"] == 16
    with pytest.raises(ValueError, match="dense"):
        mixtral.Model.config_from_gguf({**kv, "llama.expert_count": 0}, "llama")


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)
