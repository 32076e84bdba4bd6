"""Granite MoE against transformers on tiny random configs (fp32): its four multipliers
(embeddings, residual branches, attention logits, output logits) set far from 1, a softmax
over the router's top-k logits, the Hub's input_linear/output_linear banks, tied
embeddings; and llama.cpp's granitemoe GGUF (q/k rows permuted for GGML's rope)."""

from __future__ import annotations

import json

import pytest

from freetoken import models
from freetoken.models import granitemoe
from tests import fixtures
from tests.models import family

pytest.importorskip("transformers")

CONFIG = dict(
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    num_local_experts=8,
    num_experts_per_tok=2,
    embedding_multiplier=6.0,
    residual_multiplier=0.4,
    attention_multiplier=0.05,
    logits_scaling=3.0,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rope_parameters={"rope_type": "default", "rope_theta": 1e4},
)


def _build(tmp_path_factory, name, config, seed):
    from transformers import GraniteMoeConfig, GraniteMoeForCausalLM

    path = tmp_path_factory.mktemp(name)
    hf = fixtures.hf_model(path, GraniteMoeConfig, GraniteMoeForCausalLM, config, seed=seed)
    return path, hf


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return _build(tmp_path_factory, "granitemoe", CONFIG, 81)


def test_logits_and_greedy_tokens_match_transformers(hub):
    family.logits_match(*hub)
    family.greedy_matches(*hub)


def test_cached_decode_equals_uncached_forward(hub):
    family.cached_decode_matches(hub[0])


def test_batched_sequences_match_single(hub):
    family.batched_matches_single(*hub)


def test_every_policy_matches_resident(hub):
    family.policies_match_resident(hub[0], num_experts=8, moe_layers=3)


def test_the_hub_s_names_and_show(hub):
    path, _ = hub
    key = granitemoe.Model.expert_key("model.layers.2.block_sparse_moe.input_linear.weight")
    assert (key.layer, key.bank, key.transposed) == (2, "gate_up", False)
    assert granitemoe.Model.dense_key("model.layers.0.block_sparse_moe.router.layer.weight") == (
        "model.layers.0.mlp.gate.weight"
    )
    config = json.loads((path / "config.json").read_text())
    info = models.model_info(config, {"model_info": granitemoe.Model.model_info(config)})
    assert info["general.architecture"] == "granitemoe"
    assert info["granitemoe.logit_scale"] == 3.0 and info["granitemoe.embedding_scale"] == 6.0


def test_gguf_import_matches_transformers(hub, tmp_path):
    family.gguf_matches(*hub, tmp_path, "granitemoe")
