"""DeepSeek-V4 against transformers on tiny random configs (fp32, decisive routing).

Two configs between them set every option: sliding-window layers, compressed sparse
attention (overlapping windows, the lightning indexer keeping fewer entries than exist) and
heavily compressed attention, with windows inside a page and spanning pages; hash-routed
layers beside scored top-k ones (√softplus and sigmoid); YaRN on the compressed rope and
plain rope; 2 and 3 hyper-connection streams; grouped output projections; the shared expert
(one, whatever n_shared_experts says); transformers 5's config and fused experts, and the
Hub's config spelling (compress_ratios, num_hash_layers, qk_rope_head_dim) and checkpoint
names (layers.{l}.attn.wq_a, ffn.experts.{e}.w1, ...) with a multi-token-prediction layer.
"""

from __future__ import annotations

import json

import pytest

from freetoken.models.deepseek_v4 import ModelArgs
from tests.models import family, mla, v4

BASE = dict(
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=24,
    n_routed_experts=8,
    num_experts_per_tok=2,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=8,
    index_head_dim=16,
    index_topk=3,
    sliding_window=6,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
)
MIXED = dict(
    BASE,
    layer_types=[v4.SLIDING, v4.SPARSE, v4.HEAVY, v4.SPARSE],
    compress_rates={v4.SPARSE: 4, v4.HEAVY: 8},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    hc_mult=2,
    hc_sinkhorn_iters=5,
    partial_rotary_factor=0.5,
    routed_scaling_factor=1.5,
    rope_parameters={
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
)
HUB = dict(
    BASE,
    layer_types=[v4.HEAVY, v4.SPARSE, v4.SLIDING],
    num_hidden_layers=3,
    compress_rates={v4.SPARSE: 4, v4.HEAVY: 16},
    mlp_layer_types=["hash_moe", "hash_moe", "moe"],
    hc_mult=3,
    partial_rotary_factor=0.25,
    scoring_func="sigmoid",
    n_shared_experts=2,
    routed_scaling_factor=2.0,
)


def _build(tmp_path_factory, name, config, seed, **kw):
    path = tmp_path_factory.mktemp(name)
    return path, v4.build(path, config, seed=seed, **kw)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    return _build(tmp_path_factory, "ds4-mixed", MIXED, 31, original_format=False)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    path, hf = _build(tmp_path_factory, "ds4-hub", HUB, 32)
    v4.hub_spelling(path, hf)
    return path, hf


@pytest.mark.parametrize("fixture", ["mixed", "hub"])
def test_logits_match_transformers(fixture, request):
    family.logits_match(*request.getfixturevalue(fixture), prompt=family.LONG[:40])


@pytest.mark.parametrize("fixture", ["mixed", "hub"])
def test_cached_decode_equals_uncached_forward(fixture, request):
    path, _ = request.getfixturevalue(fixture)
    family.cached_decode_matches(path, prompt=family.LONG[:30])


@pytest.mark.parametrize("fixture", ["mixed", "hub"])
def test_greedy_continuation_matches_transformers(fixture, request):
    family.greedy_matches(*request.getfixturevalue(fixture))


def test_batched_sequences_match_single(mixed):
    family.batched_matches_single(*mixed)


def test_every_policy_streaming_and_resize_equal_resident(mixed):
    path, hf = mixed
    family.policies_match_resident(path, hf.config.n_routed_experts, moe_layers=4)


@pytest.mark.parametrize("fixture", ["mixed", "hub"])
def test_fixed_shape_decode_gives_the_same_tokens(fixture, request):
    mla.fixed_shape_decode_matches(*request.getfixturevalue(fixture))


def test_prefix_cache_reuse_matches_transformers(mixed):
    family.prefix_reuse_matches(*mixed)


def test_bf16_keeps_what_transformers_keeps_in_fp32(mixed):
    from transformers import DeepseekV4ForCausalLM

    family.bf16_dtypes_match(mixed[0], DeepseekV4ForCausalLM)


def test_show_describes_the_model(mixed, tmp_path):
    info = v4.show_describes(*mixed, tmp_path)
    assert info["deepseek4.attention.compress_ratios"] == [0, 4, 8, 4]
    assert info["deepseek4.hash_layer_count"] == 1
    assert info["deepseek4.hyper_connection_count"] == 2


def test_model_file_reads_both_spellings(mixed, hub):
    a = ModelArgs.from_dict(json.loads((mixed[0] / "config.json").read_text()))
    assert a.ratios == (0, 4, 8, 4) and a.hash_layers == (0,) and a.rope_dim == 16
    assert a.rope_scaling.kind == "yarn" and a.rope_scaling.attention_factor == 1.0
    b = ModelArgs.from_dict(json.loads((hub[0] / "config.json").read_text()))
    assert b.ratios == (16, 4, 0) and b.hash_layers == (0, 1) and b.rope_dim == 8
    assert b.rope_scaling.kind == "default" and b.scoring_func == "sigmoid"


@pytest.mark.gpu
@pytest.mark.parametrize("policy,slots", [("resident", 0), ("lru-pcie", 13)])
def test_captured_decode_on_a_gpu_matches_transformers(mixed, policy, slots):
    mla.captured_decode_matches(*mixed, policy, slots)


@pytest.mark.gpu
def test_on_a_gpu_with_fused_kernels_and_graphs_matches_transformers(mixed):
    """fp32 on a GPU: prefill and decode through the sparse kernel, decode steps captured,
    alone and batched with a prefill longer than a decode step."""
    family.gpu_matches(*mixed)
