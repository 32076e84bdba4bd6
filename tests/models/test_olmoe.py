"""OLMoE against transformers on tiny random configs (fp32): q/k RMSNorm over the whole
projection before the heads split, q/k/v/o biases, clipped q/k/v, softmax top-k without
renormalisation, both checkpoint layouts, and llama.cpp's olmoe GGUF."""

from __future__ import annotations

import json

import pytest

from freetoken.models import olmoe
from tests import fixtures
from tests.models import family

CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_experts=8,
    num_experts_per_tok=2,
    norm_topk_prob=False,
    attention_bias=True,
    clip_qkv=1.5,  # clamps a good share of q, k and v
    rms_norm_eps=1e-5,
    max_position_embeddings=512,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    pad_token_id=0,
    eos_token_id=None,
)
# what llama.cpp's olmoe converter writes: no biases, no clipping
GGUF_CONFIG = {**CONFIG, "attention_bias": False, "clip_qkv": None}


def _build(tmp_path_factory, name, config, seed, original_format=True):
    from transformers import OlmoeConfig, OlmoeForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(
        path,
        OlmoeConfig,
        OlmoeForCausalLM,
        config,
        seed=seed,
        original_format=original_format,
        rerandomize_params=family.rerandomize_with_biases,
    )
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _build(tmp_path_factory, "olmoe", CONFIG, seed=31)


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    return _build(tmp_path_factory, "olmoe-fused", CONFIG, seed=32, original_format=False)


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
    model = olmoe.Model.from_config(config)
    attn = model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (64,) and attn.k_norm.weight.shape == (32,)
    assert attn.o_proj.bias is not None and attn.clip_qkv == 1.5
    assert olmoe.ModelArgs.from_dict(family.hub_spelling(config)) == model.args
    info = olmoe.Model.model_info(config)
    assert info["olmoe.expert_count"] == 8 and info["olmoe.feed_forward_length"] == 32


def test_gguf_import_matches_transformers(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "olmoe-gguf", GGUF_CONFIG, seed=33)
    family.gguf_matches(path, hf, tmp_path_factory.mktemp("gguf"), "olmoe")


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs(hub):
    family.gpu_matches(*hub)
